"""Shared steps of the failure-mode tests: a long streaming request through the client API."""

from __future__ import annotations

import random
import time

from coli.serve.client import Client


def long_stream(run, o, max_tokens=3000):
    """A Client and a generator streaming a long greedy generation (first token already received)."""
    c = Client(run.name, base=str(run.run_base))
    it = c.stream(o["prompt_ids"], max_tokens, greedy=True, ignore_eos=True, token_timeout=30)
    first = next(it)
    assert isinstance(first, int)
    return c, it


def drain_until_error(it, exc_type, timeout=5.0):
    """Consume the stream; return (exception, seconds until it was raised)."""
    t0 = time.monotonic()
    try:
        for _ in it:
            if time.monotonic() - t0 > timeout + 5:
                raise AssertionError("the stream kept going")
    except exc_type as e:
        return e, time.monotonic() - t0
    raise AssertionError(f"the stream ended without {exc_type.__name__}")


def inject_seed_for(pattern, rate=0.5):
    """A COLI_INJECT_SEED whose first hits come out as `pattern` (True = the fault fires), for a COLI_INJECT
    fault drawn at that rate with random.Random(seed), as stages/faults.py draws it."""
    for seed in range(10_000):
        rng = random.Random(seed)
        if all((rng.random() < rate) == want for want in pattern):
            return seed
    raise AssertionError("no seed found")
