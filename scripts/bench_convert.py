#!/usr/bin/env python3
"""Converter throughput on a GLM-5-shaped slice: FP8 in, int4 (default) out.

    .venv/bin/python scripts/bench_convert.py [--experts 32] [--layers 1] [--format int4] [--group 64]
        [--dense int8] [--threads 2] [--workdir DIR] [--keep] [--cold]

Builds a synthetic checkpoint in the GLM-5-FP8 hub layout with the real GLM-5 matrix shapes (hidden 6144,
expert width 2048, 64 heads, q_lora 2048, kv_lora 512, indexer 32 x 128, dense width 12288) but few layers and
experts, a 4096-token vocabulary and no MTP layer, its fp8 codes uniformly random (the converter's speed does not depend on the
values), then runs `coli convert` on it in a subprocess and reports input MB/s (FP8 bytes + scales read per
second of conversion wall time, process start included; also per CPU-second of the converter process and the
load average around the run, since the machine may be shared), output size, the child's peak RSS against the largest
tensor and the checkpoint size, and the implied time for the ~746 GB converted from GLM-5-FP8 (756 GB minus the
skipped MTP layer). `--cold` evicts the source files from the page cache first (posix_fadvise DONTNEED on our own
files only), so the source is read from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fp8_checkpoint as mk  # noqa: E402

GLM5_CONVERTED_BYTES = 746e9   # 756 GB FP8 checkpoint minus the ~10 GB MTP layer the converter skips

GLM5_DIMS = dict(vocab=4096, hidden=6144, heads=64, q_lora=2048, kv_lora=512, nope=192, rope=64, v=256,
                 index_heads=32, index_dim=128, index_topk=2048, inter=12288, moe_inter=2048, n_shared=1)


def _evict(d: Path) -> None:
    for p in d.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer")
    ap.add_argument("--layers", type=int, default=1, help="MoE layers (no dense layers)")
    ap.add_argument("--format", default="int4", help="--experts format for coli convert")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--dense", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temp dir under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and container")
    ap.add_argument("--cold", action="store_true", help="evict the source from the page cache before converting")
    a = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="coli-bench-", dir=a.workdir))
    src, dst = work / "ckpt", work / "container"
    try:
        t0 = time.perf_counter()
        mk.build_checkpoint(src, seed=0, random_codes=True, tokenizer=False, shards=4, layers=a.layers, mtp=False,
                            dense_layers=0, experts=a.experts, topk=min(8, a.experts), **GLM5_DIMS)
        build_s = time.perf_counter() - t0
        from coli.safetensors_io import SafetensorsFile
        from coli.weights import find_shards
        shards, _ = find_shards(src)
        largest, skipped, total_src = 0, 0, 0
        for p in shards:
            f = SafetensorsFile(p)
            for name, t in f.tensors.items():
                total_src += t.nbytes
                if name.startswith(f"model.layers.{a.layers}."):
                    skipped += t.nbytes
                else:
                    largest = max(largest, t.nbytes)
            f.close()
        if a.cold:
            _evict(src)
        cmd = [sys.executable, "-m", "coli.cli.main", "convert", str(src), str(dst), "--experts", a.format,
               "--group", str(a.group), "--dense", a.dense, "--threads", str(a.threads), "--no-progress"]
        load0 = os.getloadavg()[0]
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        load1 = os.getloadavg()[0]
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        converted = total_src - skipped
        out_bytes = sum(p.stat().st_size for p in dst.iterdir())
        rate = converted / wall
        res = {
            "format": f"{a.format} g{a.group}" if a.format in ("int4", "int2") else a.format, "dense": a.dense,
            "threads": a.threads, "cold_source": a.cold, "cpus": os.cpu_count(),
            "experts": a.experts, "moe_layers": a.layers,
            "input_bytes_converted": converted, "mtp_bytes_skipped": skipped, "output_bytes": out_bytes,
            "wall_s": round(wall, 2), "input_MB_per_s": round(rate / 1e6, 1),
            "cpu_s": round(cpu, 2), "user_s": round(ru1.ru_utime - ru0.ru_utime, 2),
            "sys_s": round(ru1.ru_stime - ru0.ru_stime, 2), "input_MB_per_cpu_s": round(converted / cpu / 1e6, 1),
            "load_avg_before_after": [round(load0, 2), round(load1, 2)],
            "largest_tensor_bytes": largest, "checkpoint_bytes": total_src,
            "peak_rss_bytes": peak_rss, "peak_rss_over_largest_tensor": round(peak_rss / largest, 2),
            "glm5_fp8_implied_minutes": round(GLM5_CONVERTED_BYTES / rate / 60, 1),
            "build_s": round(build_s, 1), "converter_note": r.stderr.strip().splitlines()[-1],
        }
        print(json.dumps(res, indent=1))
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
