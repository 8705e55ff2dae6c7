"""scripts/bench_prefill_layer.py on the CPU: without a GPU it refuses in one line (the benchmark itself runs on the
H200: docs/perf-notes.md); bad arguments are named; its launch labels tell the parts of a layer apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_prefill_layer.py"
sys.path.insert(0, str(ROOT / "scripts"))

import bench_prefill_layer as bpl  # noqa: E402
from test_pf_kernel_sweep import _gpu_present  # noqa: E402


@pytest.mark.skipif(_gpu_present(), reason="a GPU is here: the benchmark would run, not refuse")
def test_refuses_in_one_line_without_a_gpu():
    p = subprocess.run([sys.executable, str(SCRIPT), "--S", "64"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in p.stderr, p.stderr


@pytest.mark.parametrize("args,named", [(["--S", "512,1"], "--S"), (["--S", "x"], "--S"), (["--fmt", "int3"], "int3")])
def test_bad_arguments_are_named(args, named):
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and named in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_labels_name_weights_splits_and_attention_parts():
    names = {1000: "q_a", 2000: "kv_b", 3000: "shared_gate"}

    def L(op, kernel, *args):
        return {"op": op, "kernel": kernel, "args": args}
    launches = [L("rms_norm", "rms_norm", 7), L("linear_many", "pf_split_rows", 5, 6),
                L("linear_many", "pf_linear_int8", 1000, 4),
                L("mla_attend", "gemm_nn_int8", 2000, 3), L("mla_attend", "attn_split", 9),
                L("mla_attend", "gemm_nt_int8", 2000, 8), L("swiglu", "pf_linear_int8", 3000),
                L("swiglu", "silu_mul", 11), L("swiglu", "pf_split_rows", 12), L("swiglu", "pf_linear_int8", 3000)]
    assert bpl.label_launches(launches, names) == [
        "rms_norm: rms_norm", "linear_many q_a: pf_split_rows", "linear_many q_a: pf_linear_int8",
        "mla_attend q_abs: gemm_nn_int8", "mla_attend context: attn_split", "mla_attend o: gemm_nt_int8",
        "swiglu shared_gate: pf_linear_int8", "swiglu: silu_mul", "swiglu shared_gate: pf_split_rows",
        "swiglu shared_gate: pf_linear_int8"]
    # a long prefill's attention in blocks of rows: each block's kv_b products are its q_abs and its o
    blocks = [L("mla_attend", "gemm_nn_int8", 2000), L("mla_attend", "attn_split", 9),
              L("mla_attend", "gemm_nt_int8", 2000)] * 2
    assert bpl.label_launches(blocks, names) == ["mla_attend q_abs: gemm_nn_int8", "mla_attend context: attn_split",
                                                 "mla_attend o: gemm_nt_int8"] * 2


def test_the_benchmarked_layer_is_the_forwards_without_its_routed_experts():
    """dense_layer (what the script times) gives layer_body's hidden state exactly when every routed slot is pruned
    (the routed sum then adds nothing): the same ops on the same inputs, the routed experts left out."""
    import numpy as np
    from coli.bench.dense_layer import RandomDense, dense_config, layer_body
    from coli.config import PRESETS
    from coli.model.backend import cos_sin_table
    from coli.model.forward import GlmMoeDsaModel
    from coli.model.numpy_backend import NumpyBackend
    cfg = dense_config(PRESETS["tiny"], layers=1, vocab=64)
    b = NumpyBackend()
    model = GlmMoeDsaModel(cfg, RandomDense(cfg, "int8", group=32), b)
    S = 7
    pos = np.arange(S)
    cos, sin = cos_sin_table(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    h0 = np.random.default_rng(0).standard_normal((S, cfg.hidden_size)).astype(np.float32)
    model.route_override = lambda i, n: (np.full((n, cfg.num_experts_per_tok), -1, np.int64),
                                         np.zeros((n, cfg.num_experts_per_tok), np.float32))
    caches = [model.new_cache(S), model.new_cache(S)]
    for c in caches:
        c.reserve(S)
    want, _ = layer_body(model, 0, h0, pos, cos, sin, caches[0], 0)
    got = bpl.dense_layer(model, h0, pos, cos, sin, caches[1])
    np.testing.assert_array_equal(got, want)
    assert float(np.abs(got - h0).max()) > 0
