"""scripts/pf_sass_counts.py on the real toolchain (nvcc, cuobjdump; no GPU): the main loop it finds in the
prefill kernels is the K loop -- 64 IMMAs per warp step (4 row tiles x 4 quads x 2 part pairs x 2 MMAs) -- and its
flush counts follow the PF_EPI formulas (9, 7 and 6 fp32 operations per output, 32 outputs a step), also where
PF_SKIP 2 puts a second copy of the quads in the loop; without cuobjdump it refuses in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import pf_sass_counts as sc  # noqa: E402
from pf_kernel_sweep import VARIANTS  # noqa: E402
from test_kernels_compile import NVCC  # noqa: E402

CUOBJDUMP = sc.find_cuobjdump(None)
needs_tools = pytest.mark.skipif(NVCC is None or CUOBJDUMP is None,
                                 reason="needs nvcc and cuobjdump (the CUDA toolkit's, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


@needs_tools
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,fp_per_output", [("default", 7), ("epi2-skip", 6), ("skip", 9)])
def test_the_main_loop_step_has_64_immas_and_the_flush_of_its_epi(name, fp_per_output):
    row = sc.analyse(name, VARIANTS[name], "90", NVCC, CUOBJDUMP)
    for k, r in row["kernels"].items():
        c = r["counts"]
        assert c["IMMA"] == 64, (k, c)
        # 32 outputs a step; beyond the flush only the 8 group scales' fp16 -> fp32 conversions count as FP (and
        # EPI 2's two factors per quad, fe / 2^7 and -(M + M / 2^7) fe)
        assert 32 * fp_per_output <= c["FP"] <= 32 * fp_per_output + 16, (k, c)
        assert c["BAR"] == 1 and c["LDG"] >= 5, (k, c)     # one barrier; the next stage's 5 cp.async at least
        assert r["registers"] and r["total"] == sum(c.values())


def test_the_step_path_follows_the_longest_imma_path_and_skips_the_tests_of_a_partial_warp():
    """A hand-written loop body: a copy branch (taken: more copies), then a dispatch to a straight-line body or a
    per-quad tested one with the same IMMAs -- the path is the copying, straight-line one."""
    body = [(0x00, "BAR.SYNC.DEFER_BLOCKING 0x0"),
            (0x10, "@P0 BRA 0x30"),                         # no copies past the end: skip them
            (0x20, "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]"),
            (0x30, "IMMA.16832.U8.S8 R4, R8.ROW, R12.COL, R4"),
            (0x40, "@P1 BRA 0x80"),                         # a partial warp: the tested body
            (0x50, "IMMA.16832.U8.S8 R4, R8.ROW, R12.COL, R4"),
            (0x60, "FFMA R1, R2, R3, R1"),
            (0x70, "BRA 0xc0"),
            (0x80, "@P2 BRA 0xc0"),                         # its quad test
            (0x90, "IMMA.16832.U8.S8 R4, R8.ROW, R12.COL, R4"),
            (0xa0, "FFMA R1, R2, R3, R1"),
            (0xb0, "FADD R1, R2, R3"),
            (0xc0, "@!P3 BRA 0x0")]                         # the back edge
    path = sc.step_path(body)
    assert [p.split()[0] for p in path] == ["BAR.SYNC.DEFER_BLOCKING", "@P0", "LDGSTS.E.BYPASS.128",
                                            "IMMA.16832.U8.S8", "@P1", "IMMA.16832.U8.S8", "FFMA", "BRA", "@!P3"]
    assert sc.count_loop(path)["counts"]["IMMA"] == 2


def test_without_cuobjdump_the_script_refuses_in_one_line(tmp_path):
    env = {**os.environ, "PATH": str(Path(NVCC).parent) if NVCC else "/nonexistent"}
    env.pop("COLI_CUOBJDUMP", None)
    code = ("import sys, runpy; sys.modules['nvidia'] = None; sys.argv = ['pf_sass_counts.py', '--only', 'default'];"
            f" runpy.run_path({str(ROOT / 'scripts' / 'pf_sass_counts.py')!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "cuobjdump" in p.stderr, p.stderr
