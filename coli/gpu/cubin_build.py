"""For the device scripts: a kernel file built with nvcc under -D settings (scripts/moe_kernel_sweep.py,
scripts/pf_kernel_sweep.py): its cubin, and per kernel the registers and spill bytes ptxas reported; and the CUDA
backend or the one-line refusal where there is none (scripts/pf_kernel_sweep.py, scripts/bench_prefill_layer.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME or /usr/local/cuda; None where there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for p in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if p and Path(p, "bin", "nvcc").is_file():
            return str(Path(p, "bin", "nvcc"))
    return None


def build_cubin(source: str, cc: str, defs: dict, nvcc: str = "nvcc") -> tuple[bytes, dict[str, list[int]]]:
    """nvcc -cubin of cuda/<source> for sm_<cc> with -D<k>=<v> for each setting -> (cubin bytes, {kernel:
    [registers, spill store bytes]}). A failed build raises RuntimeError with the tail of nvcc's output."""
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "k.cubin"
        cmd = [nvcc, "-std=c++17", f"-arch=sm_{cc}", "-cubin", "-Xptxas", "-v", "-I", str(CUDA_DIR), "-o", str(out),
               *[f"-D{k}={v}" for k, v in defs.items()], str(CUDA_DIR / source)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(p.stderr[-2000:])
        return out.read_bytes(), ptxas_usage(p.stderr)


def ptxas_usage(log: str) -> dict[str, list[int]]:
    """`ptxas -v` output -> {kernel: [registers, spill store bytes]}."""
    res: dict[str, list[int]] = {}
    fn = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'|Function properties for (\w+)", line)
        if m:
            fn = m.group(1) or m.group(2)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and fn:
            res.setdefault(fn, [0, 0])[1] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            res.setdefault(fn, [0, 0])[0] = int(m.group(1))
    return res


def backend_or_refusal(tool: str):
    """(CudaBackend(), None), or (None, "<tool>: needs a CUDA GPU with PyCUDA: <why>") -- the device scripts' one-line
    refusal where there is no PyCUDA, no driver or no device, instead of a traceback."""
    try:
        from coli.gpu.cuda_backend import CudaBackend
        return CudaBackend(), None
    except Exception as e:      # noqa: BLE001 -- no PyCUDA, no driver, no device: one line
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None, f"{tool}: needs a CUDA GPU with PyCUDA: {why}"
