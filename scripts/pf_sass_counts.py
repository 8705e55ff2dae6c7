#!/usr/bin/env python3
"""Count the SASS of the tensor-core prefill kernels' main loop (cuda/prefill_mma.cu) per IMMA, by kind -- static
analysis with the real toolchain, no GPU needed:

    python scripts/pf_sass_counts.py [--only NAME ...] [--arch 90] [--json FILE] [--cuobjdump PATH]

Each variant of scripts/pf_kernel_sweep.py (its -D settings) is built by nvcc -cubin for sm_<arch> (ptxas -v gives
registers and spills), disassembled with cuobjdump -sass (found on PATH, at --cuobjdump, or in the pip package
nvidia-cuda-cuobjdump), and for pf_gateup_int4 / pf_down_int4 the main loop -- the backward branch whose body holds
the most IMMAs (the K loop over 64-column blocks; a warp's whole step, every quad present) -- is counted by kind:
IMMA, LDS (shared loads, ldmatrix included), LDG (global loads, cp.async and its fences), BIT (LOP3 / SHF / PRMT /
BFE ...: the nibble unpacking), INT (IMAD / IADD3 / LEA / ISETP / SEL ...: addresses and control), MOV, FP (FFMA /
FADD / FMUL: the flush), BAR, BRA (branches, BSSY / BSYNC / WARPSYNC), LCL (spills), OTHER. The counts are of one
path through the loop body (`step_path`: what one 64-column step of a warp with all its quads present issues while
the next stages' copies still go out), divided by its IMMAs.
Prints a table; --json writes the rows. Refuses in one line without nvcc or cuobjdump.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from coli.gpu.cubin_build import build_cubin, find_nvcc  # noqa: E402
from pf_kernel_sweep import VARIANTS, unknown_variants  # noqa: E402

KERNELS = ("pf_gateup_int4", "pf_down_int4")
KINDS = ("IMMA", "LDS", "LDG", "BIT", "INT", "MOV", "FP", "BAR", "BRA", "LCL", "OTHER")
_KIND_OF = {
    **dict.fromkeys(("IMMA", "HMMA"), "IMMA"),
    **dict.fromkeys(("LDS", "LDSM"), "LDS"),
    **dict.fromkeys(("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "LDC", "ULDC"), "LDG"),
    **dict.fromkeys(("LOP3", "SHF", "PRMT", "BFE", "BFI", "SGXT", "BMSK", "FLO", "POPC", "ULOP3", "USHF"), "BIT"),
    **dict.fromkeys(("IMAD", "IADD3", "VIADD", "LEA", "ISETP", "SEL", "IMNMX", "IABS", "UIADD3", "ULEA", "UIMAD",
                     "UISETP", "USEL", "IADD", "ISCADD", "PLOP3", "P2R", "R2P", "UMOV"), "INT"),
    **dict.fromkeys(("MOV", "CS2R", "S2R", "S2UR", "SHFL"), "MOV"),
    **dict.fromkeys(("FFMA", "FADD", "FMUL", "FSETP", "FSEL", "FMNMX", "HADD2", "HFMA2", "F2F", "I2F", "F2I"), "FP"),
    **dict.fromkeys(("BAR",), "BAR"),
    **dict.fromkeys(("STL", "LDL"), "LCL"),                     # spills
    **dict.fromkeys(("BRA", "BSSY", "BSYNC", "WARPSYNC", "EXIT", "BREAK", "CALL", "RET", "JMP"), "BRA"),
}
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_of(cuobjdump: str, cubin: bytes, kernel: str) -> list[tuple[int, str]]:
    """cuobjdump -sass of one kernel of a cubin -> [(address, instruction text without the predicate's '@')]."""
    with tempfile.TemporaryDirectory() as td:
        f = Path(td) / "k.cubin"
        f.write_bytes(cubin)
        p = subprocess.run([cuobjdump, "-sass", "-fun", kernel, str(f)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"cuobjdump -sass failed on {kernel}: {p.stderr.strip()[-300:]}")
    out = []
    for line in p.stdout.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    if not out:
        raise RuntimeError(f"cuobjdump printed no SASS for {kernel}")
    return out


def opcode(ins: str) -> tuple[str, str]:
    """'@!P0 IMAD.MOV.U32 R1, ...' -> ('IMAD', 'IMAD.MOV.U32')."""
    words = ins.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    full = words[0] if words else ""
    return full.split(".")[0], full


def kind(ins: str) -> str:
    base, full = opcode(ins)
    if base == "NOP":
        return "OTHER"
    if full.startswith("IMAD.MOV") or full.startswith("IMAD.U32") and ", RZ, RZ," in ins:
        return "MOV"                 # ptxas writes register moves as IMAD.MOV (or IMAD.U32 Rd, RZ, RZ, src)
    if base == "LDS" and ins.split()[0].startswith("@!PT"):
        return "OTHER"               # '@!PT LDS RZ, [RZ]': never executed (ptxas pads before LDGSTS)
    return _KIND_OF.get(base, "OTHER")


def _target(ins: str) -> int | None:
    m = re.search(r"\bBRA\s+(?:`\()?\s*(0x[0-9a-f]+)", ins)
    return int(m.group(1), 16) if m and opcode(ins)[0] == "BRA" else None


def main_loop(sass: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The body of the backward branch that encloses the most IMMAs (ties: the shortest body): the K loop, from its
    head to the back edge, as (address, instruction)."""
    best = None
    for k, (a, ins) in enumerate(sass):
        target = _target(ins)
        if target is None or target > a:
            continue
        lo = next(i for i, (x, _) in enumerate(sass) if x >= target)
        body = sass[lo:k + 1]
        n_mma = sum(opcode(s)[0] == "IMMA" for _, s in body)
        key = (n_mma, -len(body))
        if n_mma and (best is None or key > best[0]):
            best = (key, body)
    if best is None:
        raise RuntimeError("no loop with IMMAs in this kernel")
    return best[1]


def step_path(body: list[tuple[int, str]]) -> list[str]:
    """The instructions one pass through the loop body issues on the path of a warp in a full step: of all paths
    from the head to the back edge (forward branches taken or not), the one with the most IMMAs, then the most
    global copies (a step that still issues the next stage's copies), then the fewest conditional branches after
    the first IMMA (PF_SKIP 2's straight-line body, not its per-quad tests), then the most instructions (the copy
    code's common case over its shortcuts). Predicated-off padding ('@!PT') is left out."""
    addr = [a for a, _ in body]
    index = {a: i for i, a in enumerate(addr)}
    n = len(body)
    best: dict[tuple[int, bool], tuple | None] = {}

    def walk(i: int, seen: bool):
        """Best (IMMA, LDG, -late branches, count, path) from instruction i to the back edge; None: leaves the loop."""
        key = (i, seen)
        if key in best:
            return best[key]
        vec, path, res = [0, 0, 0, 0], [], None
        j = i
        while True:
            ins = body[j][1]
            if ins.split()[0] != "@!PT":
                k = kind(ins)
                vec[0] += k == "IMMA"
                vec[1] += opcode(ins)[0] == "LDGSTS"
                vec[3] += 1
                path.append(ins)
                seen = seen or k == "IMMA"
            t = _target(ins)
            if j == n - 1:                       # the back edge: one step done
                res = (*vec, path)
                break
            if t is not None:
                cond = ins.startswith("@")
                succ = [index[t]] if t in index and t > body[j][0] else []   # forward jumps only
                if not (succ or cond):
                    break                        # an unconditional jump out of the loop
                if cond:
                    succ.append(j + 1)
                    vec[2] -= seen               # a test after the first IMMA
                opts = [r for r in (walk(s_, seen) for s_ in succ) if r is not None]
                if opts:
                    b = max(opts, key=lambda r: r[:4])
                    res = (vec[0] + b[0], vec[1] + b[1], vec[2] + b[2], vec[3] + b[3], path + b[4])
                break
            j += 1
        best[key] = res
        return res
    r = walk(0, False)
    if r is None:
        raise RuntimeError("no path through the loop body reaches its back edge")
    return r[4]


def count_loop(path: list[str]) -> dict:
    """Counts by kind, the total and the instructions per IMMA of one step's path."""
    c = dict.fromkeys(KINDS, 0)
    for s in path:
        c[kind(s)] += 1
    total = sum(c.values())
    n = max(c["IMMA"], 1)
    return {"counts": c, "total": total, "per_imma": round(total / n, 2),
            "non_imma_per_imma": round((total - c["IMMA"]) / n, 2)}


def find_cuobjdump(given: str | None) -> str | None:
    if given:
        return given
    found = shutil.which("cuobjdump") or os.environ.get("COLI_CUOBJDUMP")
    if found:
        return found
    nvcc = find_nvcc()                         # the CUDA toolkit ships it next to nvcc
    if nvcc and (Path(nvcc).resolve().parent / "cuobjdump").is_file():
        return str(Path(nvcc).resolve().parent / "cuobjdump")
    try:                                       # the pip package nvidia-cuda-cuobjdump ships the binary
        import nvidia.cu13  # type: ignore[import-not-found]
        cand = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump"
        return str(cand) if cand.is_file() else None
    except Exception:                          # noqa: BLE001 -- not installed: refused below in one line
        return None


def analyse(name: str, defs: dict, arch: str, nvcc: str, cuobjdump: str) -> dict:
    cubin, regs = build_cubin("prefill_mma.cu", arch, defs, nvcc)
    row = {"defs": defs, "kernels": {}}
    for k in KERNELS:
        r = count_loop(step_path(main_loop(sass_of(cuobjdump, cubin, k))))
        r["registers"], r["spill_bytes"] = regs.get(k, [None, None])
        row["kernels"][k] = r
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="variant names of scripts/pf_kernel_sweep.py (default: all)")
    ap.add_argument("--arch", default="90", help="the sm_ number to build for (default 90: the H200)")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--cuobjdump", help="the cuobjdump binary (default: PATH, $COLI_CUOBJDUMP, nvidia-cuda-cuobjdump)")
    a = ap.parse_args()
    refusal = unknown_variants("pf_sass_counts", a.only)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    nvcc = find_nvcc()
    cuobjdump = find_cuobjdump(a.cuobjdump)
    if nvcc is None or cuobjdump is None:
        print("pf_sass_counts: needs nvcc and cuobjdump (the CUDA toolkit, or pip install nvidia-cuda-cuobjdump); "
              f"missing: {'nvcc' if nvcc is None else 'cuobjdump'}", file=sys.stderr)
        return 2
    names = a.only or list(VARIANTS)
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as ex:
        futs = {n: ex.submit(analyse, n, VARIANTS[n], a.arch, nvcc, cuobjdump) for n in names}
    rows = {n: f.result() for n, f in futs.items()}
    head = f"{'variant':24} {'kernel':8} {'regs':>4} {'spill':>5} {'total':>5} {'/IMMA':>5} " + \
        " ".join(f"{k:>5}" for k in KINDS)
    print(head)
    for n, row in rows.items():
        for k, r in row["kernels"].items():
            print(f"{n:24} {k[3:-5]:8} {r['registers']:>4} {r['spill_bytes']:>5} {r['total']:>5} "
                  f"{r['per_imma']:>5} " + " ".join(f"{r['counts'][x]:>5}" for x in KINDS))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
