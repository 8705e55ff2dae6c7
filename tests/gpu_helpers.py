"""Helpers for the GPU tests (tests/gpu/): stored matrices and expert records in every container format with
their numpy dequantisation, comparisons, and a report file the GPU suite collects. Importable without PyCUDA."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from coli.container.format import MatrixLayout, RecordLayout
from coli.container.quant import decode_matrix, dequantize, encode_matrix, quantize

F32 = np.float32
# Relative error allowed between two fp32 computations that differ only in summation order: over a reduction
# of K terms the rounding walks ~sqrt(K) * 2^-24 relative, ~8e-6 at K = 16384 (GLM-5's o_proj). 2e-6 (the
# first guess) failed on the H200 at 2.3e-6 for int4 at K = 6144/16384 -- rounding, not a defect.
TOL = 1e-5


def qweight(gb, buf, lay):
    """Tile bytes of a stored matrix -> a QWeight on the device of backend gb."""
    from coli.gpu.cuda_weights import upload_stored
    return upload_stored(gb.rt, buf, lay, (lay.rows, lay.cols), "test")


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def random_quantised(rows: int, cols: int, fmt: str, group: int, rng: np.random.Generator, scale: float = 0.05):
    """(data [rows, row_data_bytes], meta [rows, row_meta_bytes]) of a random matrix in `fmt`.
    Big int4/int8 matrices are drawn directly as random codes and fp16 scales (quantising floats would be slow)."""
    lay = MatrixLayout.make(rows, cols, fmt, group, 512)
    if fmt in ("int4", "int8") and rows * cols > 4_000_000:
        data = rng.integers(0, 256, (rows, lay.row_data_bytes), dtype=np.uint8)
        if fmt == "int4":
            # keep nibble 0 (-8) out, like the quantiser (q in -7..7)
            data = np.where((data & 0x0F) == 0, data | 0x01, data)
            data = np.where((data & 0xF0) == 0, data | 0x10, data).astype(np.uint8)
            sc = rng.uniform(0.2, 1.0, (rows, lay.n_groups)) * scale / 7
        else:
            data = np.where(data == 0x80, np.uint8(0x81), data).astype(np.uint8)
            sc = rng.uniform(0.2, 1.0, (rows, 1)) * scale / 127 * 3
        meta = np.ascontiguousarray(sc.astype(np.float16)).view(np.uint8).reshape(rows, -1)
        return data, meta, lay
    w = (rng.standard_normal((rows, cols)) * scale).astype(F32)
    data, meta = quantize(w, fmt, group)
    return data, meta, lay


def stored_matrix(rows: int, cols: int, fmt: str, rng: np.random.Generator, group: int = 64, tile_kb: int = 512,
                  reference: bool = True):
    """-> (tile bytes uint8 [nbytes], layout, dequantised float32 [rows, cols] or None)."""
    data, meta, _ = random_quantised(rows, cols, fmt, group, rng)
    lay = MatrixLayout.make(rows, cols, fmt, group, tile_kb)
    buf = encode_matrix(lay, data, meta)
    ref = decode_matrix(buf, lay) if reference else None
    return buf, lay, ref


def stored_rows_reference(data: np.ndarray, meta: np.ndarray, lay: MatrixLayout, rows: np.ndarray) -> np.ndarray:
    return dequantize(data[rows], meta[rows], lay.fmt, lay.group, lay.cols)


def random_record(hidden: int, inter: int, fmt: str, rng: np.random.Generator, group: int = 64, tile_kb: int = 512):
    """One expert record (uint8 [layout.nbytes]) and its dequantised gate, up, down."""
    lay = RecordLayout.make(hidden, inter, fmt, group, tile_kb)
    buf = np.zeros(lay.nbytes, np.uint8)
    mats = []
    for m in lay.matrices:
        data, meta, _ = random_quantised(m.rows, m.cols, fmt, group, rng)
        buf[m.offset:m.end] = encode_matrix(m, data, meta)
        mats.append(decode_matrix(buf[m.offset:m.end], m))
    return buf, lay, mats


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite values in the GPU result"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def report(kind: str, **fields) -> None:
    """Append a JSON line to $COLI_GPU_REPORT/gpu-results.jsonl (the GPU suite prints them)."""
    d = os.environ.get("COLI_GPU_REPORT")
    if not d:
        return
    Path(d).mkdir(parents=True, exist_ok=True)
    with open(Path(d) / "gpu-results.jsonl", "a") as f:
        f.write(json.dumps({"kind": kind, **fields}, default=float) + "\n")


def build_fresh_oracle(out_root: str, name: str, base_seed: int, opts: dict, tries: int = 12) -> tuple[str, int]:
    """Build oracle `name` with the first seed from base_seed on that passes make_oracle's safety checks.
    Module-level so a process pool can run it (the e2e tests build their oracles in parallel)."""
    import make_oracle
    last = ""
    for seed in range(base_seed, base_seed + tries):
        d = Path(out_root) / f"{name}-{seed}"
        try:
            make_oracle.build_oracle(d, seed=seed, **opts)
            return str(d), seed
        except make_oracle.OracleUnsafe as e:
            last = str(e)
    raise RuntimeError(f"no safe oracle for {name} in seeds {base_seed}..{base_seed + tries - 1}: {last}")


def build_fresh_oracles(out_root, configs: dict[str, tuple[int, dict]]) -> dict[str, tuple[Path, int]]:
    """All configs at once, one process each (spawned: the parent may hold a CUDA context)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(configs), mp_context=ctx) as ex:
        futs = {n: ex.submit(build_fresh_oracle, str(out_root), n, base, opts) for n, (base, opts) in configs.items()}
        out = {}
        for n, f in futs.items():
            d, seed = f.result()
            out[n] = (Path(d), seed)
    return out


def container(root: Path, src, name: str, **opts) -> Path:
    """The container ROOT/NAME converted from oracle SRC with ConvertOptions(**opts), converted once per module
    root (the tests of one module share their containers)."""
    from coli.container.writer import ConvertOptions, convert
    dst = root / name
    if not dst.exists():
        convert(src, dst, ConvertOptions(**opts))
    return dst


def greedy(model, prompt, n: int, cache=None, capacity: int = 256):
    """-> (n greedy tokens after PROMPT, the KV cache they were decoded into). A given CACHE continues a
    conversation; otherwise a new one of CAPACITY positions (the graph tests grow it to get a graph per size)."""
    cache = cache if cache is not None else model.new_cache(capacity)
    toks = [model.greedy(prompt, cache)]
    while len(toks) < n:
        toks.append(model.greedy([toks[-1]], cache))
    return toks, cache
