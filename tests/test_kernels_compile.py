"""Every kernel source in cuda/ compiles with nvcc for the GPU generations ColiStream targets (sm_86, sm_89,
sm_90, sm_120), and the CUDA backend's argument types match the kernels' C signatures. No GPU needed; skipped
with a reason where nvcc is absent."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coli.gpu.cuda_runtime import MODULES, kernel_sources, kernels_dir

ARCHS = ("sm_86", "sm_89", "sm_90", "sm_120")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for p in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if p and Path(p, "bin", "nvcc").is_file():
            return str(Path(p, "bin", "nvcc"))
    return None


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check cuda/*.cu)")


def test_kernel_sources_are_package_data_with_header_comments():
    srcs = kernel_sources()
    assert sorted(p.stem for p in srcs) == sorted(MODULES)
    for p in srcs + [kernels_dir() / "coli_common.cuh"]:
        first = p.read_text().splitlines()[0]
        assert first.startswith(f"// {p.name} --"), f"{p.name}: the header comment must open the file"
    assert not (kernels_dir() / "__init__.py").exists(), "cuda/ is data, not a Python package"


@needs_nvcc
@pytest.mark.timeout(1800)
def test_every_kernel_compiles_for_every_target_arch(tmp_path):
    jobs = [(src, arch) for src in kernel_sources() for arch in ARCHS]

    def build(job):
        src, arch = job
        out = tmp_path / f"{src.stem}.{arch}.cubin"
        r = subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-std=c++17", "-I", str(kernels_dir()), "-o", str(out),
                            str(src)], capture_output=True, text=True)
        return src.name, arch, r.returncode, r.stderr, out

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(build, jobs))
    failed = [f"{name} for {arch}:\n{err}" for name, arch, rc, err, _ in results if rc != 0]
    assert not failed, "\n".join(failed)
    for name, arch, _, err, out in results:
        assert out.stat().st_size > 0, f"{name} for {arch}: empty cubin"
        assert "warning" not in err.lower(), f"{name} for {arch}: {err}"


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


@needs_nvcc
def test_backend_argument_types_match_the_kernel_signatures():
    from coli.gpu.cuda_backend import SIGNATURES

    declared: dict[tuple[str, str], str] = {}
    for src in kernel_sources():
        r = subprocess.run([NVCC, "-E", "-std=c++17", "-I", str(kernels_dir()), str(src)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        for name, params in _KERNEL_RE.findall(r.stdout):
            declared[(src.stem, name)] = "".join(_argchar(p) for p in params.split(",") if p.strip())
    missing = sorted(set(SIGNATURES) - set(declared))
    assert not missing, f"the backend names kernels that do not exist: {missing}"
    wrong = {k: (SIGNATURES[k], declared[k]) for k in SIGNATURES if SIGNATURES[k] != declared[k]}
    assert not wrong, f"argument types differ (backend, kernel): {wrong}"



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
