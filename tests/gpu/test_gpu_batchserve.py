"""Continuous batching through the stage runtime on the GPU (`coli up --device gpu`, VRAM slot pool over the RAM
tier's pinned arena): concurrent requests joining and leaving a batch each get exactly their solo tokens
(transformers' for the oracle prompt, the numpy path's alone for the others; one cancelled, one sampled), and a
GPU lost mid-batch (injected) demotes the run to the CPU with every running sequence still exact."""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

import pytest

from gpu_helpers import build_fresh_oracles, container, report
from oracles import load_oracle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from batch_streams import Stream, alone, executor_stats  # noqa: E402
from harness import Run  # noqa: E402

from coli.model.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

FRESH = {"bserve-default": (911, {})}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-bserve")


@pytest.fixture(scope="module")
def oracle(root):
    src, _ = build_fresh_oracles(root, FRESH)["bserve-default"]
    return src, container(root, src, "bserve-f32", experts="f32", dense="f32")


def _run(d, tag, extra_env=None, prefill_chunk="8"):
    """6 VRAM slots: the experts stream, so `prefill_chunk` is the step's budget (8: prompts chunked beside the
    decode rows as with --step-tokens 8; "0": auto, from the device's memory: whole prompts in one step)."""
    short = Path(tempfile.mkdtemp(prefix="cb", dir="/tmp"))       # ipc:// paths must stay under 107 bytes
    r = Run(d, f"b{tag}", short / "runs", short / "cache", 1.0, extra_env,
            ("--device", "gpu", "--vram-slots", "6", "--max-batch", "3", "--step-tokens", "8",
             "--prefill-chunk", prefill_chunk))
    st = r.wait_ready(180)
    return r, st


def _mix(run, p):
    started = threading.Event()
    streams = {
        "full": Stream(run, p, 32, started=started),
        "short": Stream(run, p[:5], 24, after=started),
        "cut": Stream(run, p[3:17], 200, after=started, stop_after=6),
        "sampled": Stream(run, p[2:12], 20, after=started, greedy=False, temperature=0.7, top_k=10, top_p=0.9,
                          seed=77),
    }
    streams["late"] = Stream(run, p[1:20], 16, after=streams["short"].finished)
    for s in streams.values():
        s.start()
    for s in streams.values():
        s.join(240)
    return streams


def _check(src, o, streams):
    p = o["prompt_ids"]
    for k, s in streams.items():
        assert s.error is None, (k, s.error)
    assert streams["full"].tokens == o["greedy_tokens"]
    assert streams["short"].tokens == alone(src, p[:5], 24)
    assert streams["late"].tokens == alone(src, p[1:20], 16)
    assert streams["sampled"].tokens == alone(src, p[2:12], 20, SamplingParams(False, 0.7, 0.9, 10, 77))
    assert streams["cut"].tokens == alone(src, p[3:17], 6)


def test_gpu_stage_batch_gives_each_request_its_solo_tokens(oracle):
    src, d = oracle
    o = load_oracle(src)
    run, st = _run(d, "solo")
    try:
        assert st.get("device") == "cuda", run.output()
        streams = _mix(run, o["prompt_ids"])
        ex = executor_stats(run)
        report("gpu_batch_stage", **{k: ex.get(k) for k in ("steps", "rows", "prefill_tokens_fed", "decode_tokens_fed",
                                                            "cancelled", "failed", "copies", "vram_slots")},
               equal={k: s.error is None for k, s in streams.items()})
        _check(src, o, streams)
        assert ex["rows"] > ex["steps"] and ex.get("vram_slots") == 6 and ex["failed"] == 0
    finally:
        run.stop()


def test_gpu_stage_with_the_auto_prefill_chunk_feeds_whole_prompts_and_each_request_keeps_its_solo_tokens(oracle):
    src, d = oracle
    o = load_oracle(src)
    run, st = _run(d, "chunk", prefill_chunk="0")
    try:
        assert st.get("device") == "cuda", run.output()
        streams = _mix(run, o["prompt_ids"])
        ex = executor_stats(run)
        report("gpu_batch_prefill_chunk", **{k: ex.get(k) for k in ("steps", "rows", "prefill_chunk", "experts_stream",
                                                                    "prefill_tokens_fed", "copies")})
        _check(src, o, streams)
        assert ex["experts_stream"] == 1 and ex["prefill_chunk"] >= len(o["prompt_ids"]), ex
    finally:
        run.stop()


def test_gpu_lost_mid_batch_demotes_and_every_sequence_stays_exact(oracle):
    src, d = oracle
    o = load_oracle(src)
    run, _ = _run(d, "lost", {"COLI_INJECT": "gpu_lost:0.05", "COLI_INJECT_SEED": "3"})
    try:
        streams = _mix(run, o["prompt_ids"])
        log = run.coli("logs", "--name", run.name, "--stage", "executor", timeout=60).stdout
        report("gpu_batch_demotion", demoted="gpu_lost_demoting_to_cpu" in log,
               errors={k: str(s.error) for k, s in streams.items() if s.error})
        assert "gpu_lost_demoting_to_cpu" in log, log[-3000:]
        _check(src, o, streams)
    finally:
        run.stop()
