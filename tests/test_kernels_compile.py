"""Every kernel source in cuda/ compiles with nvcc for the GPU generations ColiStream targets (sm_86, sm_89,
sm_90, sm_120), and the CUDA backend's argument types match the kernels' C signatures. No GPU needed; skipped
with a reason where nvcc is absent."""

from __future__ import annotations

import re

import pytest

from coli.gpu.cuda_runtime import MODULES, kernel_sources, kernels_dir
from coli.gpu.cubin_build import find_nvcc

ARCHS = ("sm_86", "sm_89", "sm_90", "sm_120")


NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check cuda/*.cu)")


def test_kernel_sources_are_package_data_with_header_comments():
    srcs = kernel_sources()
    assert sorted(p.stem for p in srcs) == sorted(MODULES)
    for p in srcs + [kernels_dir() / "coli_common.cuh"]:
        first = p.read_text().splitlines()[0]
        assert first.startswith(f"// {p.name} --"), f"{p.name}: the header comment must open the file"
    assert not (kernels_dir() / "__init__.py").exists(), "cuda/ is data, not a Python package"


def _cubin_builds(out_dir):
    return {(src.name, arch): ([NVCC, "-cubin", f"-arch={arch}", "-std=c++17", "-I", str(kernels_dir()), "-o",
                                str(out_dir / f"{src.stem}.{arch}.cubin"), str(src)],
                               out_dir / f"{src.stem}.{arch}.cubin")
            for src in kernel_sources() for arch in ARCHS}


@needs_nvcc
@pytest.mark.nvcc(builds=_cubin_builds)
@pytest.mark.timeout(1800)
def test_every_kernel_compiles_for_every_target_arch(nvcc_pool):
    results = nvcc_pool.results(_cubin_builds)
    assert len(results) == len(kernel_sources()) * len(ARCHS)
    failed = [f"{name} for {arch}:\n{r.stderr}" for (name, arch), r in results.items() if r.returncode != 0]
    assert not failed, "\n".join(failed)
    for (name, arch), r in results.items():
        assert r.out.stat().st_size > 0, f"{name} for {arch}: empty cubin"
        assert "warning" not in r.stderr.lower(), f"{name} for {arch}: {r.stderr}"


_KERNEL_RE = re.compile(r'extern\s+"C"\s+__attribute__\(\(global\)\)\s*void\s+'
                        r'(?:__attribute__\(\(launch_bounds\([^)]*\)\)\)\s*)?(\w+)\s*\(([^)]*)\)')


def _argchar(param: str) -> str:
    p = " ".join(param.split())
    if "*" in p:
        return "P"
    if "long long" in p:
        return "q"
    if re.match(r"(const )?float\b", p):
        return "f"
    if re.match(r"(const )?(unsigned )?int\b", p):
        return "i"
    raise AssertionError(f"unexpected kernel parameter type: {param!r}")


def _preprocessed(out_dir):
    return {src: ([NVCC, "-E", "-std=c++17", "-I", str(kernels_dir()), str(src)], None)
            for src in kernel_sources()}


@needs_nvcc
@pytest.mark.nvcc(builds=_preprocessed)
def test_backend_argument_types_match_the_kernel_signatures(nvcc_pool):
    from coli.gpu.cuda_backend import SIGNATURES

    declared: dict[tuple[str, str], str] = {}
    for src, r in nvcc_pool.results(_preprocessed).items():
        assert r.returncode == 0, r.stderr
        for name, params in _KERNEL_RE.findall(r.stdout):
            declared[(src.stem, name)] = "".join(_argchar(p) for p in params.split(",") if p.strip())
    missing = sorted(set(SIGNATURES) - set(declared))
    assert not missing, f"the backend names kernels that do not exist: {missing}"
    wrong = {k: (SIGNATURES[k], declared[k]) for k in SIGNATURES if SIGNATURES[k] != declared[k]}
    assert not wrong, f"argument types differ (backend, kernel): {wrong}"



def test_norm_block_size_matches_the_kernels():
    """The norm kernels are built with __launch_bounds__(NORM_THREADS) (a launch with more threads fails) and keep a
    row of up to NORM_U x NORM_THREADS values in registers: the host's NORM_THREADS must be norm.cu's."""
    from coli.gpu.cuda_backend import NORM_THREADS
    m = re.search(r"#define NORM_THREADS (\d+)", (kernels_dir() / "norm.cu").read_text())
    assert m, "norm.cu no longer defines NORM_THREADS"
    assert int(m.group(1)) == NORM_THREADS


def test_tensor_core_moe_block_size_matches_the_kernels():
    """The host launches moe_gateup_mma_int4 / moe_down_mma_int4 with MMA_THREADS threads and the down kernel
    with rows / MMA_DOWN_ROWS blocks; the kernels index their warps up to MMA_WARPS (__launch_bounds__(32 *
    MMA_WARPS, ...)) and give each down block 16 * MMA_DT rows. A mismatch would fail every launch or leave
    rows uncomputed, so the numbers must agree."""
    from coli.gpu.cuda_backend import MMA_DOWN_ROWS, MMA_THREADS
    src = (kernels_dir() / "moe_mma.cu").read_text()
    m = re.search(r"#define MMA_WARPS (\d+)", src)
    assert m, "moe_mma.cu no longer defines MMA_WARPS"
    assert 32 * int(m.group(1)) == MMA_THREADS
    m = re.search(r"#ifndef MMA_DT\s*\n#define MMA_DT (\d+)", src)
    assert m, "moe_mma.cu no longer defines MMA_DT"
    assert 16 * int(m.group(1)) == MMA_DOWN_ROWS
