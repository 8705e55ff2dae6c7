"""Layer-ahead prefill copies on the GPU (coli/gpu/layer_ahead.py, VramExperts' `ahead_layers`): a prefill of a few
hundred tokens through a VRAM pool with room for two layers' experts copies every expert of the next MoE layer on the
speculative lane (and its first MoE layer's from the step's start), gives the tokens it gives without them, and
computes nothing on the CPU; `coli run`'s loader and the stage runtime's executor get the copies exactly where the
pool has room and COLI_PREFILL_AHEAD is on.

The tiny oracle (transformers-built, a seed no other test uses) has 3 MoE layers of 16 experts, top-4: a 300-token
prompt routes to all 16 in every layer (>= AHEAD_FRACTION), a decode step to 4 (never). Two layers beside the
staging: 2 * 16 + 4 = 36 slots; every expert resident would be 48, so 40 slots stream."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from gpu_helpers import build_fresh_oracles, container, greedy, report

pytestmark = pytest.mark.gpu

FRESH = {"prefill-ahead": (1409, {})}
SLOTS = 40            # >= 36: room for two layers beside the staging; < 48: the experts stream
PROMPT = 300
NEW = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-prefill-ahead")


@pytest.fixture(scope="module")
def tiny(root):
    src, seed = build_fresh_oracles(root, FRESH)["prefill-ahead"]
    d = container(root, src, "prefill-ahead-int4", experts="int4", dense="int8", group=64)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    prompt = [int(t) for t in np.random.default_rng(seed).integers(2, vocab, PROMPT)]
    return d, prompt


def _load(d, slots, monkeypatch, switch=None):
    from coli.loader import GpuOptions, load_model
    if switch is None:
        monkeypatch.delenv("COLI_PREFILL_AHEAD", raising=False)
    else:
        monkeypatch.setenv("COLI_PREFILL_AHEAD", switch)
    return load_model(d, "gpu", gpu=GpuOptions(vram_slots=slots))


def test_coli_run_gets_the_ahead_copies_exactly_where_they_fit_and_the_switch_is_on(tiny, monkeypatch):
    d, _ = tiny
    # unset: on (layer_ahead.PREFILL_AHEAD_DEFAULT, since this test passed on the H200), where the pool has room
    for slots, switch, on in ((SLOTS, "1", True), (36, "1", True), (35, "1", False), (SLOTS, "0", False),
                              (SLOTS, None, True), (35, None, False)):
        model, cfg = _load(d, slots, monkeypatch, switch)
        vx = model.experts
        got = vx.ahead_layers
        vx.close()
        assert got == (list(cfg.moe_layers) if on else None), (slots, switch)


def _cold_ram_engine(model, d, ahead: bool):
    """The loaded model's VramExperts replaced by one over every record in pinned RAM (the cold-ram bench's host
    tier: what the stage runtime's RAM tier gives once it holds the experts), retaining, SLOTS slots."""
    from coli.container.reader import ContainerReader
    from coli.gpu.host_records import MemoryHostTier
    from coli.gpu.vram_experts import VramExperts
    model.experts.close()
    r = ContainerReader(d)
    cfg = r.config
    host = MemoryHostTier(r, list(cfg.moe_layers))
    vx = VramExperts(model.backend, host, r.record_layout, cfg.num_hidden_layers, cfg.n_routed_experts,
                     cfg.num_experts_per_tok, SLOTS, ahead_layers=list(cfg.moe_layers) if ahead else None)
    model.experts = vx
    return vx


def test_a_long_prefill_copies_the_next_layer_ahead_with_the_same_tokens_and_no_cpu_fallback(tiny, monkeypatch):
    from coli.loader import load_model
    d, prompt = tiny
    out = {}
    tiles = []
    for ahead in (False, True):
        model, cfg = _load(d, SLOTS, monkeypatch)
        vx = _cold_ram_engine(model, d, ahead)
        submit = vx.spec.submit
        vx.spec.submit = lambda job, submit=submit: (tiles.append((ahead, job.tile)), submit(job))[1]
        toks, _ = greedy(model, prompt, NEW, capacity=PROMPT + NEW + 8)
        vx.finish()
        out[ahead] = (toks, vx.snapshot())
        vx.close()
    cpu, _ = load_model(d, "cpu")
    ref, _ = greedy(cpu, prompt, NEW, capacity=PROMPT + NEW + 8)
    (plain, sp), (toks, st) = out[False], out[True]
    keys = ("ahead_layers", "ahead_copies", "ahead_bytes", "spec_copies", "spec_handoffs", "spec_cancelled", "copies",
            "hits", "misses", "cpu_fallbacks", "fallback_no_slot")
    report("prefill_ahead", prompt=PROMPT, slots=SLOTS, tokens_equal=toks == plain, numpy_equal=toks == ref,
           ahead={k: st.get(k) for k in keys}, plain={k: sp.get(k) for k in keys})
    assert toks == plain                                  # the copies change when bytes cross, never what is computed
    assert st["cpu_fallbacks"] == 0 and sp["cpu_fallbacks"] == 0
    # the prefill copied every MoE layer ahead, all 16 experts each (the pool was empty): the first from the step's
    # start (300 rows of top-4 of 16 expect every expert), each later one from the layer before it; the decode steps
    # (4 experts a layer) never
    assert st["ahead_layers"] == len(cfg.moe_layers) and st["ahead_first"] == 1
    assert st["ahead_copies"] == st["ahead_layers"] * cfg.n_routed_experts
    # some landed before the next layer's step cancelled the rest (the lane trickles while the router waits)
    assert st["ahead_bytes"] > 0 and st["spec_copies"] + st["spec_handoffs"] > 0
    assert sp["ahead_layers"] == sp["ahead_copies"] == sp["ahead_bytes"] == 0 and sp["spec_copies"] == 0
    # the ahead copies go in 4 MiB tiles (layer_ahead.AHEAD_TILE_BYTES), not the guesses' --stream-tile-kb
    from coli.gpu.layer_ahead import AHEAD_TILE_BYTES
    assert tiles and all(on for on, _ in tiles) and {t for _, t in tiles} == {AHEAD_TILE_BYTES}


def test_the_first_moe_layer_copies_from_the_steps_start_and_changes_no_result(tiny, monkeypatch):
    """One prefill forward, then the decode, on the cold-ram engine with and without the ahead copies: the prefill's
    logits as close as the GPU path is to the numpy path (the copies only move which experts are resident when a
    layer's step begins, hence how its experts split into launch batches: a different order of the same float32
    sums, never different terms), the same tokens; the stats after the prefill show the first MoE layer copied from
    the step's start (before its router) and ahead copies landed."""
    from coli.loader import load_model
    d, prompt = tiny
    out = {}
    for ahead in (False, True):
        model, cfg = _load(d, SLOTS, monkeypatch)
        vx = _cold_ram_engine(model, d, ahead)
        cache = model.new_cache(PROMPT + NEW + 8)
        logits = model.forward(prompt, cache)                          # [1, V], the prompt's last row
        vx.finish()
        after_prefill = vx.snapshot()
        toks, _ = greedy(model, [int(np.argmax(logits[-1]))], NEW - 1, cache=cache)
        vx.finish()
        out[ahead] = (logits, [int(np.argmax(logits[-1]))] + toks, after_prefill, vx.snapshot())
        vx.close()
    cpu, _ = load_model(d, "cpu")
    ref = cpu.forward(prompt, cpu.new_cache(PROMPT + 8))
    (l_off, t_off, p_off, s_off), (l_on, t_on, p_on, s_on) = out[False], out[True]
    gpu_vs_numpy = float(np.abs(l_off - ref).max())
    on_vs_off = float(np.abs(l_on - l_off).max())
    keys = ("ahead_first", "ahead_layers", "ahead_copies", "ahead_bytes", "spec_copies", "spec_handoffs",
            "spec_cancelled", "hits", "misses", "copies", "cpu_fallbacks")
    report("prefill_ahead_first", prompt=PROMPT, slots=SLOTS, on_vs_off=on_vs_off, gpu_vs_numpy=gpu_vs_numpy,
           tokens_equal=t_on == t_off, prefill_on={k: p_on.get(k) for k in keys},
           prefill_off={k: p_off.get(k) for k in keys})
    assert t_on == t_off
    assert on_vs_off <= gpu_vs_numpy, (on_vs_off, gpu_vs_numpy)
    assert s_on["cpu_fallbacks"] == 0 and s_off["cpu_fallbacks"] == 0
    E, moe = cfg.n_routed_experts, list(cfg.moe_layers)
    assert p_on["ahead_first"] == 1 and p_on["ahead_layers"] == len(moe) and p_on["ahead_copies"] == len(moe) * E
    # some landed before the steps that wanted them (whole: found resident; or a prefix the demand took over)
    assert p_on["ahead_bytes"] > 0 and p_on["spec_copies"] + p_on["spec_handoffs"] > 0
    assert s_on["ahead_first"] == 1                               # the decode steps (one row) never
    assert p_off["ahead_first"] == p_off["ahead_copies"] == 0


def test_a_short_prompt_copies_nothing_from_the_steps_start(tiny, monkeypatch):
    """A prompt of 2 rows (top-4 of 16 expects 7 of 16 experts, below 3/4; at most 8 asked, so no later layer copies
    ahead either): no first-layer copies; its tokens as without the ahead copies."""
    d, prompt = tiny
    out = {}
    for ahead in (False, True):
        model, _ = _load(d, SLOTS, monkeypatch)
        vx = _cold_ram_engine(model, d, ahead)
        toks, _ = greedy(model, prompt[:2], NEW, capacity=NEW + 16)
        vx.finish()
        out[ahead] = (toks, vx.snapshot())
        vx.close()
    assert out[True][0] == out[False][0]
    assert out[True][1]["ahead_first"] == 0 and out[True][1]["ahead_copies"] == 0


def test_the_stage_runtime_copies_ahead_on_a_long_prompt(tmp_path, tiny, monkeypatch):
    """`coli up --device gpu --vram-slots 40`: the executor's VramExperts (over the RAM tier's arena) copies ahead;
    two requests of the long prompt (the second finds every expert in the RAM tier); tokens as `coli run`'s."""
    import sys
    import tempfile
    from pathlib import Path
    d, prompt = tiny
    model, _ = _load(d, SLOTS, monkeypatch, "1")         # the Run below inherits COLI_PREFILL_AHEAD=1
    want, _ = greedy(model, prompt, NEW, capacity=PROMPT + NEW + 8)
    model.experts.close()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from harness import Run
    short = Path(tempfile.mkdtemp(prefix="ca", dir="/tmp"))     # ipc:// paths must stay under 107 bytes
    r = Run(d, "ahead", short / "runs", short / "cache", 1.0, None, ("--device", "gpu", "--vram-slots", str(SLOTS)))
    try:
        st = r.wait_ready(180)
        assert st.get("device") == "cuda", r.output()
        ids = ",".join(map(str, prompt))
        got = []
        for _ in range(2):
            p = r.coli("chat", "--name", r.name, "--prompt-ids", ids, "-n", str(NEW), "--json", "--ignore-eos",
                       timeout=300)
            assert p.returncode == 0, p.stderr + r.output()
            got.append(json.loads(p.stdout.strip().splitlines()[-1])["tokens"])
        time.sleep(1.2)          # the executor publishes its counters every 0.5 s: let the second request's land
        stats = json.loads(r.coli("stats", "--name", r.name, "--once", "--json", timeout=60).stdout)
    finally:
        r.stop()
    ex = stats.get("executor", {})
    report("prefill_ahead_stage", **{k: ex.get(k) for k in ("ahead_layers", "ahead_copies", "ahead_bytes",
                                                            "copies", "cpu_fallbacks", "vram_slots")})
    assert got == [want, want]
    assert ex.get("vram_slots") == SLOTS and ex.get("ahead_layers", 0) > 0 and ex.get("ahead_bytes", 0) > 0
    assert ex.get("cpu_fallbacks") == 0
