"""Bounded soak: tens of thousands of expert requests through the real RAM tier and reader (as an
executor would send them: batched per layer, leases given back), while the real executor generates
through the supervisor on the same run. The resident memory (VmRSS) of every process of the run must
stay flat after warm-up.

The bound is derived from the leak it must catch: the RAM tier used to keep ~124 B per expert request
(a never-pruned request -> peer map; ~9 GB per million GLM-5 tokens). Growth must stay under 16 B per
request the run handled plus a fixed slack of 512 KiB for allocator granularity (RSS moves in pages and
in pymalloc/glibc arenas; measured here: at most ~140 KiB per process). A leak of L B/request fails the
test once (L - 16) x N > 512 KiB: at N ~ 20,000 requests, any leak above ~42 B/request. The old map
overshoots the bound ~3x (checked by putting it back: the RAM tier grew 3.4 MB, bound 0.86 MB)."""

import json
import random
import threading
import time
from pathlib import Path

import pytest

from coli.serve.client import Client
from coli.protocol.messages import ExpertFailed, ExpertRelease, ExpertRequest
from hostile import Intruder, container_of
from oracles import load_oracle

N_REQUESTS = 16_000      # the soak, after warm-up
IN_FLIGHT = 4            # expert requests outstanding at once: 16 leases, within the 20 a foreign peer may hold
LEAK_BYTES = 16          # per request: the smallest leak the bound must catch
SLACK = 512 * 1024


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def expert_requests(spy, cfg, n, rng):
    """`n` demand requests of top-k experts of a random MoE layer; every grant's lease is given back."""
    sent, owed = 0, {}
    while sent < n or owed:
        while sent < n and len(owed) < IN_FLIGHT:
            sent += 1
            ids = rng.sample(range(cfg.n_routed_experts), cfg.num_experts_per_tok)
            spy.send(ExpertRequest(sent, rng.choice(cfg.moe_layers), ids, True))
            owed[sent] = len(ids)
        (m,) = spy.replies(1)
        assert not isinstance(m, ExpertFailed), m
        spy.send(ExpertRelease(list(m.slots)))
        owed[m.request_id] -= len(m.experts)
        if not owed[m.request_id]:
            del owed[m.request_id]


def stats(run) -> dict:
    return json.loads(run.coli("stats", "--name", run.name, "--once", "--json").stdout)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_stage_keeps_flat_rss_over_a_soak(default_oracle, start_run):
    o = load_oracle(default_oracle)
    # 40 of the 48 experts fit: most requests hit, and evictions keep the reader busy too
    run = start_run(default_oracle, ram_gb=0.004)
    c = container_of(run)
    cfg = c.config
    c.close()
    pids = {**run.stage_pids, "supervisor": run.proc.pid}
    rng = random.Random(13)
    spy = Intruder(run, "ramtier", b"soak-executor")
    client = Client(run.name, base=str(run.run_base))
    want = o["greedy_tokens"][:24]
    generated, stop, bad = [], threading.Event(), []

    def generate():  # the real executor's path, meanwhile
        while not stop.is_set():
            toks = client.generate(o["prompt_ids"], 24, greedy=True, ignore_eos=True).tokens
            generated.append(len(toks))
            if toks != want:
                bad.append(toks)

    try:
        expert_requests(spy, cfg, 3000, rng)                       # warm-up: every code path, every cache
        client.generate(o["prompt_ids"], 24, greedy=True, ignore_eos=True)
        before_stats = stats(run)
        before = {n: vm_rss(p) for n, p in pids.items()}
        t = threading.Thread(target=generate)
        t.start()
        try:
            expert_requests(spy, cfg, N_REQUESTS, rng)
        finally:
            stop.set()
            t.join(60)
        time.sleep(1.2)                                            # a stats tick after the last release
        after = {n: vm_rss(p) for n, p in pids.items()}
        after_stats = stats(run)
    finally:
        spy.close()
        client.close()
    assert not bad, f"the executor served other tokens during the soak: {bad[0]}"
    assert generated, "no generation ran during the soak"
    n = N_REQUESTS + after_stats["executor"]["expert_requests"] - before_stats["executor"]["expert_requests"]
    bound = n * LEAK_BYTES + SLACK
    growth = {k: after[k] - before[k] for k in pids}
    print(f"soak: {n} expert requests, {sum(generated)} tokens generated; RSS growth (bytes) {growth}, "
          f"bound {bound}")
    for stage, g in growth.items():
        assert g < bound, (f"{stage} grew {g} B over {n} expert requests ({g / n:.1f} B each; bound "
                           f"{LEAK_BYTES} B each + {SLACK} B): {growth}")
    rt = after_stats["ramtier"]
    assert rt["requests_in_flight"] == 0 and rt["leases_held"] == 0, rt
    assert after_stats["reader"]["records"] > before_stats["reader"]["records"], "the soak never read from disk"
