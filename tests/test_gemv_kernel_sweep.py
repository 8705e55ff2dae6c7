"""scripts/gemv_kernel_sweep.py on the CPU: its "default" variant is the build cuda/gemv.cu and cuda/attention.cu
ship and the host's rows per item follow it; every variant it builds compiles (nvcc, no GPU), the shipped one
without spilling; its float64 check holds a float32 evaluation in another order and rejects a wrong one; a bad
variant name and a machine without a GPU get one line. (The sweep itself runs on a GPU: docs/perf-notes.md.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gemv_kernel_sweep as sweep  # noqa: E402
from test_kernels_compile import NVCC, needs_nvcc  # noqa: E402
from test_pf_kernel_sweep import _gpu_present, run_script  # noqa: E402


@pytest.mark.skipif(_gpu_present(), reason="a GPU is here: the sweep would run, not refuse")
def test_the_sweep_refuses_in_one_line_without_a_gpu():
    p = run_script("gemv_kernel_sweep.py")
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "needs PyCUDA and a GPU" in p.stderr, p.stderr


def test_an_unknown_variant_is_named_before_anything_runs():
    p = run_script("gemv_kernel_sweep.py", "--only", "pf1", "pf9")
    assert p.returncode == 2 and "pf9" in p.stderr and "pf1," in p.stderr, p.stderr


def test_the_default_variant_is_the_shipped_build():
    """The sweep's reference is the kernels as the backend builds them: its settings are the sources' defaults."""
    gemv = (ROOT / "cuda" / "gemv.cu").read_text()
    attn = (ROOT / "cuda" / "attention.cu").read_text()
    for k, v in sweep.SHIPPED.items():
        assert f"#ifndef {k}\n#define {k} {v}\n" in gemv, k
    for k, v in sweep.SHIPPED_ATTN.items():
        assert f"#ifndef {k}\n#define {k} {v}\n" in attn, k
    assert sweep.VARIANTS["default"] == {"gemv": sweep.SHIPPED, "attention": None}
    for name, v in sweep.VARIANTS.items():        # every variant names only settings the sources have
        assert set(v["gemv"]) == set(sweep.SHIPPED), name
        assert v["attention"] is None or set(v["attention"]) == set(sweep.SHIPPED_ATTN), name


def _variant_builds(out_dir):
    out = {}
    for name, v in sweep.VARIANTS.items():
        for module in ("gemv", "attention"):
            defs = v[module]
            if defs is None:
                continue
            cubin = out_dir / f"{name}-{module}.cubin"
            out[f"{name}/{module}"] = ([NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-I",
                                        str(ROOT / "cuda"), "-o", str(cubin), *[f"-D{k}={x}" for k, x in defs.items()],
                                        str(ROOT / "cuda" / f"{module}.cu")], cubin)
    return out


@needs_nvcc
@pytest.mark.nvcc(builds=_variant_builds)
@pytest.mark.timeout(600)
def test_every_variant_compiles_for_sm_90_and_the_shipped_gemvs_do_not_spill(nvcc_pool):
    from coli.gpu.cubin_build import ptxas_usage
    results = nvcc_pool.results(_variant_builds)
    assert sorted(results) == sorted(_variant_builds(Path("/nonexistent")))
    for name, r in results.items():
        assert r.returncode == 0 and r.out.stat().st_size > 0, f"{name}: {r.stderr[-1500:]}"
        assert not re.search(r"\bwarning\b", r.stderr.replace("ptxas info", ""), re.I), f"{name}: {r.stderr[-800:]}"
    use = ptxas_usage(results["default/gemv"].stderr)
    for k in ("gemv2_int8", "gemv2_int4", "gemv2x_int8", "gemv2x_int4", "moe_gateup_int8", "moe_down_int8"):
        regs, spill = use[k]
        assert spill == 0, f"{k} spills {spill} bytes in the shipped build"


def test_the_float64_check_holds_fp32_in_any_order_and_rejects_a_wrong_gemv():
    """f64_close: y = W x summed in fp32 in two orders (rows of three matrices, one after another) is within the
    bound; a result with one row off by 1 % of its magnitude (sum |w x|), or with two rows swapped, is not."""
    rng = np.random.default_rng(11)
    cols = 2048
    ws = [((rng.integers(-127, 128, (r, cols))) * rng.uniform(1e-4, 4e-4, (r, 1))).astype(np.float32)
          for r in (64, 16, 8)]
    x = rng.standard_normal(cols).astype(np.float32)
    W = np.concatenate(ws)
    y_fwd = np.array([np.float32(0) + np.cumsum(W[i] * x, dtype=np.float32)[-1] for i in range(W.shape[0])])
    halves = (W[:, :cols // 2] * x[:cols // 2]).sum(1, dtype=np.float32) + \
        (W[:, cols // 2:] * x[cols // 2:]).sum(1, dtype=np.float32)               # a split in two segments
    for y in (y_fwd, halves.astype(np.float32)):
        ok, ratio = sweep.f64_close(y, ws, x)
        assert ok and ratio < 1, ratio
    mag = np.abs(W.astype(np.float64)) @ np.abs(x.astype(np.float64))
    wrong = y_fwd.copy()
    wrong[5] += np.float32(0.01 * mag[5])             # one product of the row's 2,048 off by ~1 % of the magnitude
    assert not sweep.f64_close(wrong, ws, x)[0]
    swapped = y_fwd.copy()
    swapped[[3, 70]] = swapped[[70, 3]]
    assert not sweep.f64_close(swapped, ws, x)[0]
