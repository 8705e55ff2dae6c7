"""MTP through the stage processes on the GPU (`coli up --device gpu`): a request with mtp on and one with 3, each
sharing the batched steps with a greedy and a sampled request that do not draft, then each alone, get the tokens
without MTP -- transformers' on an f32 container of an oracle with an MTP layer added (experts resident, and
streamed through 6 VRAM slots), the same run's `mtp off` tokens on an int4 container -- and the others their solo
tokens; the executor counted the drafts."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from batch_streams import Stream, alone, executor_stats
from checkpoints import with_mtp_layer
from coli.model.sampling import SamplingParams
from coli.serve.client import Client
from gpu_helpers import container
from harness import Run
from oracles import load_oracle, oracle_dir

pytestmark = pytest.mark.gpu

SAMPLED = SamplingParams(False, 0.7, 0.9, 10, 77)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-mtp-stages")


@pytest.fixture(scope="module")
def src(root):
    o = oracle_dir(root, "default")
    return o, with_mtp_layer(o, root / "with-mtp", seed=17)


def _run(d, tag: str, *args: str) -> Run:
    short = Path(tempfile.mkdtemp(prefix="cm", dir="/tmp"))       # ipc:// paths must stay under 107 bytes
    r = Run(d, f"m{tag}", short / "runs", short / "cache", 1.0, None, ("--device", "gpu", "--max-batch", "3", *args))
    try:
        st = r.wait_ready(180)
        assert st.get("device") == "cuda", r.output()
    except BaseException:
        r.stop()                  # nothing of a run that did not come up on the GPU outlives the test
        raise
    return r


def _beside_plain_requests(run, p, mode: str) -> dict[str, Stream]:
    """A drafting request (p, 32 tokens) and, once it decodes, a greedy and a sampled one that do not draft."""
    started = threading.Event()
    streams = {"mtp": Stream(run, p, 32, started=started, greedy=True, mtp=mode),
               "plain": Stream(run, p[2:14], 20, after=started, greedy=True),
               "sampled": Stream(run, p[1:9], 16, after=started, greedy=False, temperature=SAMPLED.temperature,
                                 top_k=SAMPLED.top_k, top_p=SAMPLED.top_p, seed=SAMPLED.seed)}
    for s in streams.values():
        s.start()
    for s in streams.values():
        s.join(240)
        assert s.error is None, (mode, s.error)
    return streams


@pytest.mark.parametrize("vram", [(), ("--vram-slots", "6")], ids=["resident", "streamed"])
def test_gpu_stages_mtp_on_and_3_give_transformers_tokens_alone_and_in_a_batch(root, src, vram):
    o = load_oracle(src[0])
    d = container(root, src[1], "f32", experts="f32", dense="f32")
    p = o["prompt_ids"]
    run = _run(d, "f32" + "s" * bool(vram), *vram)
    try:
        for mode in ("on", "3"):
            streams = _beside_plain_requests(run, p, mode)
            assert streams["mtp"].tokens == o["greedy_tokens"], mode
            assert streams["plain"].tokens == alone(d, p[2:14], 20), mode
            assert streams["sampled"].tokens == alone(d, p[1:9], 16, SAMPLED), mode
        with Client(run.name, base=str(run.run_base)) as c:
            for mode in ("on", "3"):
                assert c.generate(p, 32, greedy=True, ignore_eos=True, mtp=mode).tokens == o["greedy_tokens"], mode
        st = executor_stats(run, since=time.time())
        assert st["mtp_drafted_1"] > st["mtp_drafted_3"] > 0 and st["mtp_tokens"] == 4 * 31, st   # all four drafted
        assert st["failed"] == 0, st
    finally:
        run.stop()


def test_gpu_stages_int4_mtp_on_and_3_give_the_tokens_without_it(root, src):
    o = load_oracle(src[0])
    d = container(root, src[1], "int4", experts="int4", dense="int8", group=32)
    p = o["prompt_ids"]
    run = _run(d, "i4")
    try:
        with Client(run.name, base=str(run.run_base)) as c:
            want = c.generate(p, 32, greedy=True, ignore_eos=True, mtp="off").tokens
            want_plain = c.generate(p[2:14], 20, greedy=True, ignore_eos=True, mtp="off").tokens
        for mode in ("on", "3"):
            streams = _beside_plain_requests(run, p, mode)
            assert streams["mtp"].tokens == want and streams["plain"].tokens == want_plain, mode
        with Client(run.name, base=str(run.run_base)) as c:
            for mode in ("on", "3"):
                assert c.generate(p, 32, greedy=True, ignore_eos=True, mtp=mode).tokens == want, mode
        st = executor_stats(run, since=time.time())
        assert st["mtp_drafted_1"] > st["mtp_drafted_3"] > 0 and st["mtp_tokens"] == 4 * 31, st
        assert st["failed"] == 0, st
    finally:
        run.stop()
