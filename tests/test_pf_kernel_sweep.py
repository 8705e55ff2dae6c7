"""scripts/pf_kernel_sweep.py on the CPU: every variant of cuda/prefill_mma.cu it builds compiles (nvcc, no GPU);
its host-side shared-memory and thread counts are the backend's; its float64 bound holds a float32 evaluation and
rejects a wrong one; without a GPU it refuses in one line. (The sweep itself runs on a GPU: docs/perf-notes.md.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import pf_kernel_sweep as sweep  # noqa: E402
from test_kernels_compile import NVCC, needs_nvcc  # noqa: E402


def _gpu_present() -> bool:
    try:
        import pycuda.driver as drv
        drv.init()
        return drv.Device.count() > 0
    except Exception:       # noqa: BLE001 -- no PyCUDA or no driver: no GPU
        return False


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """scripts/NAME with ARGS in this Python, its output captured (the sweeps' refusal tests)."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(_gpu_present(), reason="a GPU is here: the sweep would run, not refuse")
def test_the_sweep_refuses_in_one_line_without_a_gpu():
    p = run_script("pf_kernel_sweep.py")
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in p.stderr, p.stderr


def test_an_unknown_variant_is_named():
    p = run_script("pf_kernel_sweep.py", "--only", "epi2", "epi9")
    assert p.returncode == 2 and "epi9" in p.stderr and "epi2," in p.stderr, p.stderr


@pytest.mark.parametrize("name", list(sweep.VARIANTS))
def test_host_block_shape_matches_the_kernel_settings(name, monkeypatch):
    import coli.gpu.cuda_backend as cb
    defs = sweep.VARIANTS[name]
    monkeypatch.setattr(cb, "PF_ROWS", defs["PF_ROWS"])
    monkeypatch.setattr(cb, "PF_TOKS", defs["PF_TOKS"])
    monkeypatch.setattr(cb, "PF_STAGES", defs["PF_STAGES"])
    assert sweep.pf_threads(defs) == cb.pf_threads() <= 1024
    for cols, group in ((6144, 64), (2048, 64), (16384, 128)):
        assert sweep.smem_bytes(defs, cols, group) == cb.pf_smem(cols, group)
        assert sweep.smem_bytes(defs, cols, 0, "int8") == cb.pf_smem(cols, 0, "int8")
    assert (cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES) != (0, 0, 0)
    assert sweep.VARIANTS["default"] == sweep.DEFAULTS


def test_the_default_variant_is_the_shipped_build():
    """The sweep's reference is the kernel as the backend builds it: its settings are prefill_mma.cu's defaults and
    the backend's block shape."""
    import coli.gpu.cuda_backend as cb
    src = (ROOT / "cuda" / "prefill_mma.cu").read_text()
    for k, v in sweep.DEFAULTS.items():
        assert f"#ifndef {k}\n#define {k} {v}" in src, k
    assert (cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES) == (256, 32, 3) == tuple(sweep.DEFAULTS[k] for k in
                                                                           ("PF_ROWS", "PF_TOKS", "PF_STAGES"))


def _variant_builds(out_dir):
    builds = {**sweep.VARIANTS, "peak": {**sweep.DEFAULTS, "PF_PEAK": 1}}
    return {name: ([NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "-I", str(ROOT / "cuda"), "-o",
                    str(out_dir / f"{name}.cubin"), *[f"-D{k}={v}" for k, v in defs.items()],
                    str(ROOT / "cuda" / "prefill_mma.cu")], out_dir / f"{name}.cubin")
            for name, defs in builds.items()}


@needs_nvcc
@pytest.mark.nvcc(builds=_variant_builds)
@pytest.mark.timeout(600)
def test_every_variant_compiles_for_sm_90_without_warnings(nvcc_pool):
    """Every variant (static_asserts on the block shape included) and the MMA-rate build (PF_PEAK) build; the
    shipped default is checked for every target arch by tests/test_kernels_compile.py."""
    results = nvcc_pool.results(_variant_builds)
    assert sorted(results) == sorted([*sweep.VARIANTS, "peak"])
    for name, r in results.items():
        assert r.returncode == 0 and r.out.stat().st_size > 0, f"{name}: {r.stderr}"
        assert "warning" not in r.stderr.lower(), f"{name}: {r.stderr}"


def _bad_block_shape(out_dir):
    return {"PF_ROWS=64": ([NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "-I", str(ROOT / "cuda"), "-DPF_ROWS=64",
                            "-DPF_TOKS=32", "-o", str(out_dir / "x.cubin"), str(ROOT / "cuda" / "prefill_mma.cu")],
                           out_dir / "x.cubin")}


@pytest.mark.nvcc(builds=_bad_block_shape)
def test_a_bad_block_shape_is_a_compile_error(nvcc_pool):
    """The kernel refuses a shape its copy rounds or tables cannot cover (here 64 rows: no whole 64-column block of h
    per gate/up block) at compile time, not with wrong results."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    r = nvcc_pool.results(_bad_block_shape)["PF_ROWS=64"]
    assert r.returncode != 0 and "static assertion" in r.stderr, r.stderr[-500:]


def _small_moe(rng, H=256, Im=128, E=3, K=2, S=9):
    def q(rows, cols):          # int4-like values times a per-64-column scale, exactly representable
        return ((rng.integers(0, 16, (rows, cols)) - 8) * np.repeat(rng.uniform(0.005, 0.02, (rows, cols // 64)),
                                                                     64, axis=1)).astype(np.float32)
    mats = {e: (q(Im, H), q(Im, H), q(H, Im)) for e in range(E)}
    x = rng.standard_normal((S, H)).astype(np.float32)
    x[2] *= 2.0 ** -12                                         # a token far smaller than the others
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (S, K)).astype(np.float32)
    return x, idx, w, mats


def _fp32_moe(x, idx, w, mats, swap=False):
    out = np.zeros_like(x)
    for s in range(x.shape[0]):
        for k in range(idx.shape[1]):
            g, u, d = mats[int(idx[s, k])]
            gv, uv = g @ x[s], u @ x[s]
            if swap:
                gv, uv = uv, gv                              # a kernel that mixed up gate and up
            h = (gv / (np.float32(1) + np.exp(-gv))) * uv
            out[s] += w[s, k] * (d @ h)
    return out


def test_the_float64_bound_holds_fp32_and_rejects_a_wrong_kernel():
    rng = np.random.default_rng(3)
    x, idx, w, mats = _small_moe(rng)
    want, bound = sweep.f64_bound(x, idx, w, mats)
    np.testing.assert_allclose(want, _fp32_moe(x.astype(np.float64), idx, w, {e: tuple(m.astype(np.float64)
                                                                                   for m in v)
                                                                                   for e, v in mats.items()}),
                               rtol=1e-12, atol=1e-14)       # the reference is the plain SwiGLU MoE
    assert (bound > 0).all()
    f32 = np.abs(_fp32_moe(x, idx, w, mats).astype(np.float64) - want) / bound
    assert f32.max() <= 1.0, f32.max()
    wrong = np.abs(_fp32_moe(x, idx, w, mats, swap=True).astype(np.float64) - want) / bound
    assert wrong.max() > 1e3, wrong.max()


def test_the_linear_bound_holds_fp32_and_rejects_a_wrong_kernel():
    """linear_f64_bound (the int8 / int4 dense GEMM's check against float64): a float32 evaluation of the same product
    (int8 codes times a row scale, a token 2^-30 below the others) lies within it; one whose weight columns are paired
    with the wrong x columns (two 4-column halves swapped, as a wrong byte permutation would) does not."""
    rng = np.random.default_rng(5)
    q = rng.integers(-127, 128, (96, 384))
    w = (q * rng.uniform(0.001, 0.01, (96, 1))).astype(np.float32)
    x = rng.standard_normal((9, 384)).astype(np.float32)
    x[4] *= np.float32(2.0 ** -30)
    want, bound = sweep.linear_f64_bound(x, w)
    np.testing.assert_allclose(want, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-13)
    assert (bound > 0).all()
    assert (np.abs((x @ w.T).astype(np.float64) - want) / bound).max() <= 1.0
    swapped = w.reshape(96, -1, 2, 4)[:, :, ::-1].reshape(96, 384)
    assert (np.abs((x @ swapped.T).astype(np.float64) - want) / bound).max() > 1e3
