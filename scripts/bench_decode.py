#!/usr/bin/env python3
"""Decode speed of the numpy engine on a tiny oracle model, and how a decode step's cost grows with
context length.

    python scripts/bench_decode.py [--model DIR] [--tokens 64] [--contexts 32,128,512,2048] [--threads 2]

Without --model it builds the default tiny oracle (scripts/make_oracle.py) in a temp dir. Prints a
table and one JSON line. Context scaling: for each context length C we prefill C tokens, then time
decode steps; cost per step should grow at most linearly in C (the absorbed MLA reads each cached
latent once per head; the indexer scores each cached key once per head).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--contexts", default="32,128,512,2048")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per context length")
    ap.add_argument("--threads", type=int, default=2, help="BLAS threads (set before numpy loads)")
    a = ap.parse_args()
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[v] = str(a.threads)
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from coli.generate import Generation
    from coli.loader import load_model

    model_dir = a.model
    if model_dir is None:
        import make_oracle
        model_dir = Path(tempfile.mkdtemp(prefix="coli-bench-")) / "oracle"
        make_oracle.build_oracle(model_dir)
    model, cfg = load_model(model_dir)
    prompt = [0] + list(range(2, 21))

    list(Generation(model, prompt, 4, ignore_eos=True))  # warm-up
    gen = Generation(model, prompt, a.tokens, ignore_eos=True)
    list(gen)
    tps = gen.stats.decode_tps

    rng = np.random.default_rng(0)
    rows = []
    for C in [int(x) for x in a.contexts.split(",")]:
        if C + a.steps > cfg.max_position_embeddings:
            continue
        cache = model.new_cache(C + a.steps + 1)
        ids = rng.integers(2, cfg.vocab_size, size=C).tolist()
        t0 = time.perf_counter()
        model.forward(ids, cache)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(a.steps):
            model.forward([int(rng.integers(2, cfg.vocab_size))], cache)
        step = (time.perf_counter() - t0) / a.steps
        rows.append({"context": C, "prefill_s": round(prefill, 4), "decode_step_ms": round(step * 1e3, 3)})

    print(f"model {model_dir} ({cfg.num_hidden_layers} layers, H {cfg.hidden_size}, {cfg.n_routed_experts} experts), "
          f"BLAS threads {a.threads}, {platform.processor() or platform.machine()}, {os.cpu_count()} cpus")
    print(f"decode: {tps:.1f} tokens/s over {a.tokens} tokens (prompt {len(prompt)})")
    print(f"{'context':>8} {'prefill s':>10} {'step ms':>9} {'step/first':>10} {'ctx/first':>9}")
    for r in rows:
        print(f"{r['context']:>8} {r['prefill_s']:>10.3f} {r['decode_step_ms']:>9.3f} "
              f"{r['decode_step_ms'] / rows[0]['decode_step_ms']:>10.2f} {r['context'] / rows[0]['context']:>9.1f}")
    print(json.dumps({"decode_tokens_per_s": round(tps, 2), "contexts": rows, "threads": a.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
