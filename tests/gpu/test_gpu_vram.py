"""The streaming GPU path: routed experts in a bounded VRAM slot pool filled by the copy lanes (coli.gpu), on
tiny GLM-5 oracles built by transformers in this run with seeds no other test uses.

- tokens equal transformers' with only a few slots (constant eviction), from a container through `coli run`'s
  host tier, and through the stage runtime (`coli up --device gpu`, the RAM tier's pinned arena);
- eviction, oversize rejection, and a speculative copy racing a demand for the same expert, each checked on
  the counters and the bytes;
- every injected fault at a high rate leaves the tokens unchanged and moves its fallback counter;
- a lost GPU (injected) demotes the stage run to the CPU, and the tokens still match.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpu_helpers import build_fresh_oracles, container, greedy, report
from oracles import load_oracle

pytestmark = pytest.mark.gpu

FRESH = {
    "vram-default": (501, {}),
    "vram-groups": (601, {"n_group": 4, "topk_group": 2}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-vram")


@pytest.fixture(scope="module")
def oracles(root):
    return build_fresh_oracles(root, FRESH)


def streaming_model(d, slots, policy="freq", **kw):
    from coli.loader import GpuOptions, load_model
    model, cfg = load_model(d, "gpu", gpu=GpuOptions(vram_slots=slots, policy=policy, **kw))
    return model, cfg


@pytest.mark.parametrize("name", list(FRESH))
@pytest.mark.parametrize("slots,policy", [(4, "freq"), (6, "lru"), (12, "rdf")])
def test_streaming_tokens_match_transformers_with_few_slots(root, oracles, name, slots, policy):
    src, seed = oracles[name]
    o = load_oracle(src)
    d = container(root, src, f"{name}-f32", experts="f32", dense="f32")
    model, cfg = streaming_model(d, slots, policy, tile_kb=16)
    toks, _ = greedy(model, o["prompt_ids"], len(o["greedy_tokens"]))
    vx = model.experts
    vx.finish()
    st = vx.snapshot()
    vx.close()
    report("vram_e2e", oracle=name, seed=seed, slots=slots, policy=policy, tokens_equal=toks == o["greedy_tokens"],
           **{k: st[k] for k in ("hits", "misses", "evictions", "cpu_fallbacks", "copies")})
    assert toks == o["greedy_tokens"]
    assert st["evictions"] > 0 and st["copies"] > 0        # the pool really was too small: constant eviction


def test_int4_streaming_equals_numpy(root, oracles):
    from coli.loader import load_model
    src, _ = oracles["vram-default"]
    o = load_oracle(src)
    d = container(root, src, "vram-default-int4", experts="int4", dense="int8", group=64)
    model, _ = streaming_model(d, 5)
    cpu, _ = load_model(d, "cpu")
    g, _ = greedy(model, o["prompt_ids"], 32)
    c, _ = greedy(cpu, o["prompt_ids"], 32)
    model.experts.close()
    assert g == c


def _vram(d, slots, host_kind="memory", **kw):
    """A VramExperts over a CUDA backend, outside a model (direct tests of the cache)."""
    from coli.container.reader import ContainerReader
    from coli.gpu.host_records import ContainerHostTier, MemoryHostTier
    from coli.gpu.vram_experts import VramExperts
    from coli.gpu.cuda_backend import CudaBackend
    r = ContainerReader(d)
    cfg = r.config
    b = CudaBackend()
    host = MemoryHostTier(r, list(cfg.moe_layers)) if host_kind == "memory" else ContainerHostTier(r)
    vx = VramExperts(b, host, r.record_layout, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok,
                     slots, **kw)
    return vx, r, b, host


def _slot_bytes_equal(vx, b, r, layer, e):
    s = vx.pool.slot_of(layer * vx.E + e)
    assert s is not None
    got = np.empty(r.record_layout.nbytes, np.uint8)
    b.rt.synchronize()
    b.rt.drv.memcpy_dtoh(got, vx.base + s * vx.slot_bytes)
    return np.array_equal(got, r.read_record(layer, e))


def _run_step(vx, b, layer, ids, x=None):
    """One decode MoE step through the backend: -> routed output [1, H] on the host."""
    H = vx.layout.down.rows
    rng = np.random.default_rng(layer * 1000 + sum(ids))
    x = rng.standard_normal((1, H)).astype(np.float32) if x is None else x
    idx = np.array([ids], np.int64)
    w = np.full((1, len(ids)), 1.0 / len(ids), np.float32)
    out = b.moe(b.upload(x), idx, w, vx.stream(layer, list(ids)))
    return b.to_host(out), x


def _cpu_step(r, layer, ids, x):
    from coli.model.numpy_backend import NumpyBackend
    nb = NumpyBackend()
    idx = np.array([ids], np.int64)
    w = np.full((1, len(ids)), 1.0 / len(ids), np.float32)
    return nb.moe(x, idx, w, ((e, r.expert(layer, e)) for e in ids))


def test_eviction_reuses_slots_and_the_bytes_are_the_new_experts(root, oracles):
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    vx, r, b, _ = _vram(d, 4, policy="lru")
    layer = r.config.moe_layers[0]
    seen = []
    for ids in ([0, 1], [2, 3], [4, 5], [6, 7], [0, 2]):
        got, x = _run_step(vx, b, layer, ids)
        want = _cpu_step(r, layer, ids, x)
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
        vx.finish()
        # every record the step handed out had its kernels queued: no copy's events left parked for a reader
        assert not vx._readers and not vx._parked
        for e in ids:
            if vx.pool.slot_of(layer * vx.E + e) is not None:
                assert _slot_bytes_equal(vx, b, r, layer, e)
        seen.append(vx.pool.stats.evictions)
    st = vx.snapshot()
    vx.close()
    report("vram_eviction", **{k: st[k] for k in ("hits", "misses", "evictions", "copies")})
    assert st["evictions"] >= 4 and st["misses"] >= 8
    assert st["cpu_fallbacks"] == 0


def test_oversize_records_go_to_the_cpu_not_truncated(root, oracles):
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    from coli.container.reader import ContainerReader
    n = ContainerReader(d).record_layout.nbytes
    vx, r, b, _ = _vram(d, 4, slot_bytes=max(4096, n - 8192))
    layer = r.config.moe_layers[0]
    ids = [1, 3, 5]
    got, x = _run_step(vx, b, layer, ids)
    want = _cpu_step(r, layer, ids, x)
    st = vx.snapshot()
    vx.close()
    assert st["fallback_oversize"] == len(ids) and st["copies"] == 0
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))


def _wait_spec_landed(vx, timeout=10.0):
    import time
    t = time.monotonic() + timeout
    while any(not j.submitted.is_set() for j in vx._spec_jobs.values()):
        assert time.monotonic() < t, "speculative copies did not finish"
        time.sleep(0.001)


@pytest.mark.parametrize("mode", ["race", "landed", "recycled"])
def test_speculative_copy_and_a_demand_for_the_same_expert(root, oracles, mode):
    """prefetch(e) puts e on the speculative lane, then the demand for e comes:
    race      at once: the demand cancels the trickle (or waits for its tile) and copies what is missing;
    landed    after the speculative copies finished: the demand is a VRAM hit, no demand copy;
    recycled  the host slot was reused after the copy (generation moved): the copy is discarded as stale and
              the demand copies again. The output is right and the slot holds the right bytes every time."""
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    ids = [2, 9, 11]
    vx, r, b, host = _vram(d, 6, tile_bytes=4096, speculate=True,   # small tiles: the trickle is slow, the race
                           spec_budget=len(ids))                     # is real; speculation asked for (off by default),
                                                                     # every guess copied (not the governor's budget)
    layer = r.config.moe_layers[-1]
    for rep in range(5):
        vx.prefetch(layer, ids)
        if mode != "race":
            _wait_spec_landed(vx)
        if mode == "recycled":
            for e in ids:
                host.recycle(layer, e)
        got, x = _run_step(vx, b, layer, ids)
        want = _cpu_step(r, layer, ids, x)
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max())), rep
        vx.finish()
        for e in ids:
            assert _slot_bytes_equal(vx, b, r, layer, e)
        for e in ids:                                    # evict them for the next round
            s = vx.pool.slot_of(layer * vx.E + e)
            if s is not None:
                vx.pool.invalidate(s)
    st = vx.snapshot()
    vx.close()
    report("vram_spec", mode=mode, **{k: st[k] for k in ("spec_loads", "spec_copies", "spec_cancelled", "spec_used",
                                                          "stale_copies", "copies", "hits", "misses")})
    assert st["spec_loads"] == 5 * len(ids)
    if mode == "landed":
        assert st["spec_copies"] == 5 * len(ids) and st["copies"] == 0 and st["hits"] == 5 * len(ids)
    if mode == "recycled":
        assert st["stale_copies"] == 5 * len(ids) and st["copies"] == 5 * len(ids)


def test_a_cut_short_speculative_copy_is_finished_by_the_demand(root, oracles):
    """A demand for an expert whose speculative trickle has landed part of its record copies only the rest into
    the same slot (spec_handoffs, spec_handoff_bytes), not the whole record again: the sum and the slot's bytes
    are right. The trickle is stopped part-way by a long copy put on the demand lane once its first tile landed
    (it yields to demand copies), so the demand finds a prefix and no complete copy."""
    import time
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    vx, r, b, host = _vram(d, 6, tile_bytes=4096, speculate=True)
    layer = r.config.moe_layers[-1]
    n = r.record_layout.nbytes
    blk_n = 64 << 20                                    # ~1 ms on the bus: the trickle waits behind it
    blk = np.zeros(blk_n, np.uint8)
    vx.drv.host_register(int(blk.ctypes.data), blk_n)
    blk_dev = b.rt.alloc(blk_n)
    tiles = []
    try:
        for rep in range(10):
            ids = [2 + rep % 6]
            vx.prefetch(layer, ids)
            job = vx._spec_jobs[vx.pool.slot_of(layer * vx.E + ids[0])]
            tiles.append(job.n_tiles)
            t = time.monotonic() + 10
            while job.bytes_done == 0 and not job.submitted.is_set():
                assert time.monotonic() < t, "the speculative trickle never started"
                time.sleep(0)
            vx.drv.copy_htod_async(int(blk_dev), int(blk.ctypes.data), blk_n, vx.demand.stream)
            got, x = _run_step(vx, b, layer, ids)
            want = _cpu_step(r, layer, ids, x)
            assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max())), rep
            vx.finish()
            assert _slot_bytes_equal(vx, b, r, layer, ids[0]), rep
            vx.pool.invalidate(vx.pool.slot_of(layer * vx.E + ids[0]))     # evicted for the next round
    finally:
        b.rt.synchronize()
        vx.drv.stream_sync(vx.demand.stream)
        vx.drv.host_unregister(int(blk.ctypes.data))
    st = vx.snapshot()
    vx.close()
    report("vram_spec_handoff", record_tiles=tiles[0], **{k: st[k] for k in (
        "spec_loads", "spec_handoffs", "spec_handoff_bytes", "spec_copies", "copies", "copy_bytes")})
    assert tiles[0] >= 3, "records of fewer than 3 tiles cannot be cut part-way"
    assert st["spec_handoffs"] >= 1
    assert st["spec_handoff_bytes"] >= 4096 * st["spec_handoffs"]
    # every demand copy of a handed-off record moved only the rest: the bytes copied add up to whole records
    assert st["copy_bytes"] + st["spec_handoff_bytes"] + st["spec_copies"] * n == 10 * n


def test_a_guess_landed_before_the_router_counts_in_the_governors_books(root, oracles):
    """The spec governor sizes its budget from the bytes of speculative copies a demand then used. A guess that has
    landed whole when its layer's router is waited for is used by that step (a VRAM hit): the governor must see its
    bytes whoever finished the copy -- the lookup, the step's reap, or the router's before_host_wait. Before
    e156d5a the step deferred its reap past the lookups (the previous step's copies pending, room for the misses),
    so `_demand_hit` finished the guess and counted it; the hook finishes it first, and the lookup found no job and
    counted nothing: the governor read every landed guess as wasted (budget 1, a pause after IDLE_STEPS). A reap
    now remembers the landed guess's bytes for the hit (review7)."""
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    vx, r, b, host = _vram(d, 6, speculate=True)         # spec_budget None: the governor's budget (1 copy at first)
    assert vx.governor is not None
    layer = r.config.moe_layers[-1]
    _run_step(vx, b, layer, [0, 1])                      # the previous step: its demand copies still pending
    vx.prefetch(layer, [2])                              # the pilot's guess for the coming step
    _wait_spec_landed(vx)
    b.before_host_wait()                                 # the coming step's router: the host waits for its top-k
    got, x = _run_step(vx, b, layer, [2, 3])             # 2: a hit on the landed guess
    want = _cpu_step(r, layer, [2, 3], x)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    vx.finish()
    st = vx.snapshot()
    ema = vx.governor.ema
    vx.close()
    assert st["spec_copies"] == 1 and st["spec_used"] == 1    # the pool saw the use
    assert ema > 0                                             # ... and so must the governor


def test_speculative_copies_are_off_by_default(root, oracles):
    """Without COLI_SPEC_COPIES=1 a pilot's RAM-resident guesses are not copied (speculation measured a net cost):
    no speculative load, no copy, and the step still computes the right sum from its demand copies."""
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    vx, r, b, host = _vram(d, 6)
    assert vx.speculate is False
    layer = r.config.moe_layers[-1]
    ids = [2, 9, 11]
    vx.prefetch(layer, ids)
    got, x = _run_step(vx, b, layer, ids)
    want = _cpu_step(r, layer, ids, x)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    vx.finish()
    st = vx.snapshot()
    vx.close()
    assert st["spec_loads"] == 0 and st["spec_copies"] == 0 and st["copies"] == len(ids)


def _two_resident(root, oracles):
    """A 6-slot LRU cache over the f32 oracle with experts 0 and 1 of the first MoE layer resident and landed:
    -> (vx, reader, backend, host tier, layer)."""
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    vx, r, b, host = _vram(d, 6, policy="lru")
    layer = r.config.moe_layers[0]
    _run_step(vx, b, layer, [0, 1])
    vx.finish()
    return vx, r, b, host, layer


def test_the_first_miss_is_on_the_bus_before_the_hits_are_launched(root, oracles):
    """A step with VRAM hits and misses: the hits are yielded, then the FLUSH that makes the backend launch their
    kernels -- and by then the first miss's copy is already issued on the demand lane (the link does not idle
    through the launch). The items and their order are what they were: hits, FLUSH, misses; the sum is right."""
    from coli.gpu.cuda_weights import FLUSH
    vx, r, b, _, layer = _two_resident(root, oracles)
    items, pending_at_flush = [], None
    for item in vx.stream(layer, [0, 2, 3]):
        if item is FLUSH:
            if pending_at_flush is None:
                pending_at_flush = [job.key for job, _rec, _s in vx._pending]
            items.append("FLUSH")
        else:
            items.append(item[0])
            item[1].on_consumed(None)                    # as the backend does once the kernels are queued
    assert items == [0, "FLUSH", 2, 3]
    assert pending_at_flush == [layer * vx.E + 2]        # expert 2's copy was issued before the FLUSH
    vx.finish()
    got, x = _run_step(vx, b, layer, [1, 4, 5])          # a hit and two misses through the backend: right sum
    want = _cpu_step(r, layer, [1, 4, 5], x)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    vx.finish()
    for e in (0, 1, 2, 3, 4, 5):
        if vx.pool.slot_of(layer * vx.E + e) is not None:
            assert _slot_bytes_equal(vx, b, r, layer, e)
    vx.close()


def test_a_step_stopped_at_the_hits_flush_leaks_no_pin_of_its_early_first_miss(root, oracles):
    """The first miss's copy is issued before the FLUSH that launches the hits; when the backend raises while
    launching them (its except gives back the records it held, then the generator is closed at that FLUSH) the
    early miss was never handed out: its slot pin must go back too (and its lease once the copy lands), or each such
    failed request leaks a slot for the rest of the run (review7: the finally did not know about it)."""
    from coli.gpu.cuda_weights import FLUSH
    vx, r, b, host, layer = _two_resident(root, oracles)
    gen = vx.stream(layer, [0, 2, 3])
    held = []
    for item in gen:
        if item is FLUSH:
            break                                        # the backend raised while launching the hits
        held.append(item[1])
    assert len(held) == 1 and vx._pending                # the hit held, the early miss's copy issued
    for rec in held:                                     # what CudaBackend.moe's except does for held records
        rec.on_consumed(None)
    gen.close()                                          # the step is abandoned at that FLUSH
    vx.finish()
    assert [vx.pool.pins(s) for s in range(vx.n_slots)] == [0] * vx.n_slots
    assert host.leases == 0
    vx.pool.check()
    got, x = _run_step(vx, b, layer, [2, 4, 5])          # the pool still serves the next step: right sum
    want = _cpu_step(r, layer, [2, 4, 5], x)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    vx.close()


def test_a_step_stopped_at_a_no_slot_flush_gives_the_waiting_record_back(root, oracles):
    """More misses than free slots: the record granted next waits at a FLUSH for the held ones to be launched. When
    the backend raises while launching them and the generator is closed at that FLUSH, its host lease must go back
    (review8: it leaked, pinning a RAM-tier slot for the rest of the run), and the pool serves the next step."""
    from coli.gpu.cuda_weights import FLUSH
    src, _ = oracles["vram-default"]
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    vx, r, b, host = _vram(d, 4, policy="lru")
    layer = r.config.moe_layers[0]
    gen = vx.stream(layer, [0, 1, 2, 3, 4, 5])
    held = []
    for item in gen:
        if item is FLUSH:
            break                                        # the backend raised while launching what it held
        held.append(item[1])
    assert 0 < len(held) < 6
    for rec in held:                                     # what CudaBackend.moe's except does for held records
        rec.on_consumed(None)
    gen.close()
    vx.finish()
    assert host.leases == 0
    assert [vx.pool.pins(s) for s in range(vx.n_slots)] == [0] * vx.n_slots
    vx.pool.check()
    got, x = _run_step(vx, b, layer, [2, 4])
    want = _cpu_step(r, layer, [2, 4], x)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    vx.close()


def test_landed_copies_are_finished_while_the_host_waits_for_the_router(root, oracles):
    """The backend calls the expert source's before_host_wait right before it blocks for a router's top-k (eager
    route, and each replayed segment's wait): the copies issued so far are finished there (slots READY, host
    leases back), so the next step has nothing to reap between its router and its first copy. Uninstalled by
    close(). Through a streaming model with graphs (segments) the hook runs at every router and the tokens are
    transformers'."""
    src, _ = oracles["vram-default"]
    o = load_oracle(src)
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    vx, r, b, host = _vram(d, 6, policy="lru")
    assert b.before_host_wait == vx._land_pending
    layer = r.config.moe_layers[0]
    _run_step(vx, b, layer, [0, 1, 2])
    assert vx._pending and host.leases > 0               # the copies are issued, their leases held
    b.before_host_wait()
    assert vx._pending == [] and host.leases == 0
    for e in (0, 1, 2):
        assert vx.pool.state(vx.pool.slot_of(layer * vx.E + e)) == "ready"
    vx.close()
    assert b.before_host_wait is None

    model, _ = streaming_model(d, 4, tile_kb=16)
    mx = model.experts
    calls = []
    inner = model.backend.before_host_wait
    assert inner == mx._land_pending

    def counted():
        calls.append(len(mx._pending))
        inner()
    model.backend.before_host_wait = counted
    n = len(o["greedy_tokens"])
    toks, _ = greedy(model, o["prompt_ids"], n)
    mx.finish()
    st = mx.snapshot()
    mx.close()
    assert toks == o["greedy_tokens"]
    assert len(calls) >= n * len(model.config.moe_layers)   # every router of every token waited through it
    assert sum(1 for c in calls if c) > 0 and st["copies"] > 0


def test_injected_faults_keep_tokens_and_move_counters(root, oracles):
    from coli.stages.faults import Faults
    src, _ = oracles["vram-groups"]
    o = load_oracle(src)
    d = container(root, src, "vram-groups-f32", experts="f32", dense="f32")
    model, _ = streaming_model(d, 6)
    faults = Faults.parse("copy_error:0.3,kernel_error:0.3,oversize:0.3", seed=7)
    model.experts.faults = faults
    model.backend.faults = faults
    toks, _ = greedy(model, o["prompt_ids"], len(o["greedy_tokens"]))
    model.experts.finish()
    st = model.experts.snapshot()
    model.experts.close()
    report("vram_faults", tokens_equal=toks == o["greedy_tokens"], injected=faults.injected,
           **{k: v for k, v in st.items() if k.startswith("fallback_")})
    assert toks == o["greedy_tokens"]
    for kind in ("copy_error", "kernel_error", "oversize"):
        assert st[f"fallback_{kind}"] > 0, kind


# ---- the stage runtime on the GPU ----------------------------------------------------------------------------
def _stage_tokens(tmp_path, d, o, extra_env=None, args=()):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "runtime"))
    from harness import Run
    import tempfile
    from pathlib import Path
    short = Path(tempfile.mkdtemp(prefix="cg", dir="/tmp"))     # ipc:// paths must stay under 107 bytes
    r = Run(d, f"g{abs(hash((str(d), tuple(args), str(extra_env)))) % 10000}", short / "runs", short / "cache",
            1.0, extra_env, ("--device", "gpu", *args))
    try:
        st = r.wait_ready(180)
        ids = ",".join(map(str, o["prompt_ids"]))
        p = r.coli("chat", "--name", r.name, "--prompt-ids", ids, "-n", str(len(o["greedy_tokens"])), "--json",
                   "--ignore-eos", timeout=300)
        assert p.returncode == 0, p.stderr + r.output()
        out = json.loads(p.stdout.strip().splitlines()[-1])
        stats = r.coli("stats", "--name", r.name, "--once", "--json", timeout=60)
        logs = r.coli("logs", "--name", r.name, "--stage", "executor", timeout=60)
        return out, st, stats.stdout, logs.stdout + r.output()
    finally:
        r.stop()


def test_stage_runtime_on_the_gpu_matches_transformers(tmp_path, root, oracles):
    src, _ = oracles["vram-default"]
    o = load_oracle(src)
    d = container(root, src, "vram-default-f32", experts="f32", dense="f32")
    out, st, stats, log = _stage_tokens(tmp_path, d, o, args=("--vram-slots", "6"))
    report("vram_stage", device=st.get("device"), vram=st.get("vram"), tokens_equal=out["tokens"] == o["greedy_tokens"])
    assert st.get("device") == "cuda", log
    assert out["tokens"] == o["greedy_tokens"]
    ex = json.loads(stats).get("executor", {})
    report("vram_stage_stats", **{k: ex.get(k) for k in ("vram_slots", "copies", "hits", "misses", "evictions",
                                                         "demand_copy_s", "sm_busy_s", "copy_busy", "sm_busy")})
    assert ex.get("vram_slots") == 6 and ex.get("copies", 0) > 0
    assert ex.get("demand_copy_s", 0) > 0 and ex.get("sm_busy_s", 0) > 0


def test_stage_runtime_faults_and_gpu_lost_demotion(tmp_path, root, oracles):
    src, _ = oracles["vram-groups"]
    o = load_oracle(src)
    d = container(root, src, "vram-groups-f32", experts="f32", dense="f32")
    env = {"COLI_INJECT": "copy_error:0.2,kernel_error:0.2,oversize:0.2,gpu_lost:0.05", "COLI_INJECT_SEED": "3"}
    out, st, stats, log = _stage_tokens(tmp_path, d, o, extra_env=env, args=("--vram-slots", "6"))
    report("vram_stage_faults", tokens_equal=out["tokens"] == o["greedy_tokens"], stats_tail=stats[-800:],
           demoted="gpu_lost_demoting_to_cpu" in log)
    assert out["tokens"] == o["greedy_tokens"]
    assert "gpu_lost_demoting_to_cpu" in log, log[-3000:]
    assert "cpu_fallback" in log
