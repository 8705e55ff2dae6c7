"""Concurrent requests to a running run, one thread and one Client each, for the batching tests (CPU and GPU):
their tokens, and the tokens a sequence gets alone (in process, numpy)."""

from __future__ import annotations

import json
import threading
import time

from coli.generate import Generation
from coli.loader import load_model
from coli.model.sampling import SamplingParams
from coli.protocol.messages import Done
from coli.serve.client import Client


def alone(d, prompt, n, params=None):
    model, _ = load_model(d)
    return list(Generation(model, prompt, n, params or SamplingParams(), ignore_eos=True))


def executor_stats(run, want_steps=1, timeout=5.0, since: float | None = None):
    """The executor's counters once it has run `want_steps` steps; with `since` (a time.time()), from a report the
    executor sent after it, so that every request answered before then is counted."""
    deadline = time.monotonic() + timeout
    while True:     # stats are republished every 0.5 s
        st = json.loads(run.coli("stats", "--name", run.name, "--once", "--json").stdout).get("executor", {})
        fresh = since is None or st.get("t", 0) > since
        if (st.get("steps", 0) >= want_steps and fresh) or time.monotonic() > deadline:
            return st
        time.sleep(0.3)


class Stream(threading.Thread):
    """One client's request in its own thread (a Client per thread: a socket is not shared across threads)."""

    def __init__(self, run, prompt, n, started: threading.Event | None = None, stop_after: int | None = None,
                 after: threading.Event | None = None, **kw):
        super().__init__(daemon=True)
        self.run_, self.prompt, self.n, self.kw = run, prompt, n, kw
        self.started, self.stop_after, self.after = started, stop_after, after
        self.tokens: list[int] = []
        self.done: Done | None = None
        self.error: Exception | None = None
        self.finished = threading.Event()

    def run(self):
        try:
            if self.after is not None:
                assert self.after.wait(120), "the request it waits for never started"
            with Client(self.run_.name, base=str(self.run_.run_base)) as c:
                it = c.stream(self.prompt, self.n, ignore_eos=True, token_timeout=60, **self.kw)
                for item in it:
                    if isinstance(item, Done):
                        self.done = item
                        break
                    self.tokens.append(item)
                    if self.started is not None and len(self.tokens) == 4:
                        self.started.set()
                    if self.stop_after is not None and len(self.tokens) == self.stop_after:
                        it.close()          # cancels the request at the executor
                        break
        except Exception as e:
            self.error = e
        finally:
            if self.started is not None:
                self.started.set()
            self.finished.set()
