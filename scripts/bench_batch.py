"""Decode throughput of one batched step (coli.model.batch) against the same sequences stepped one at a time.

    python scripts/bench_batch.py [--model DIR] [--device cpu|gpu] [--batch 1,4,8,16] [--steps 16] [--prompt 24]

For each batch size B: B prompts (different lengths, prompt..prompt+B-1 tokens, drawn from the vocabulary with a
fixed seed) are prefilled, then `steps` decode steps run twice from the same caches' state -- once as B model.greedy
calls per step, once as one greedy_batch call -- and the tokens of the two must agree. Printed per B (one JSON line):
aggregate tokens/s of each, the speed-up, and the routed experts asked per step (summed over MoE layers: one stream()
of the union for the batch, B streams alone), i.e. what a step would move over PCIe with nothing cached.
Defaults to the demo model on the CPU. On the GPU, COLI_BATCH_GRAPHS=1 replays the batched decode steps from CUDA
graphs (their replay counters are printed; the one-at-a-time steps replay the one-sequence graphs either way). On a benchmark slice (coli bench make-slice: random weights) the rows route by
its stored trace (coli.bench.trace_router), each row its own trace tokens, the same in both runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from coli.loader import load_model
from coli.model.batch import BatchRow, greedy_batch


class AskedExperts:
    """The model's expert source, counting the experts asked per stream() call."""

    def __init__(self, inner):
        self.inner = inner
        self.asked = 0
        self.calls = 0

    def stream(self, layer, ids):
        self.asked += len(ids)
        self.calls += 1
        return self.inner.stream(layer, ids)

    def begin_step(self, tokens):       # passed on: the VRAM cache starts a long prefill's first copies there
        from coli.model.forward import begin_step
        begin_step(self.inner, tokens)


def sync(model) -> None:
    rt = getattr(model.backend, "rt", None)
    if rt is not None:
        rt.synchronize()


def run(model, B: int, steps: int, prompt_len: int, seed: int = 0, routing=None) -> dict:
    rng = np.random.default_rng(seed + B)
    V = model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(0, V, prompt_len + b)] for b in range(B)]
    counter = AskedExperts(model.experts)
    model.experts = counter
    try:
        out = {}
        toks = {}
        for mode in ("alone", "batch"):
            if routing is not None:
                routing.reset(0)           # both modes route the same trace tokens, row by row
            caches = [model.new_cache(prompt_len + B + steps + 1) for _ in prompts]
            last = [model.greedy(p, c) for p, c in zip(prompts, caches)]
            seqs = [[t] for t in last]
            counter.asked = counter.calls = 0
            sync(model)
            t0 = time.perf_counter()
            for _ in range(steps):
                if mode == "alone":
                    last = [model.greedy([t], c) for t, c in zip(last, caches)]
                else:
                    last = greedy_batch(model, [BatchRow(c, [t]) for t, c in zip(last, caches)])
                for s, t in zip(seqs, last):
                    s.append(t)
            sync(model)
            dt = time.perf_counter() - t0
            out[f"{mode}_tok_s"] = round(B * steps / dt, 2)
            out[f"{mode}_experts_per_step"] = round(counter.asked / steps, 2)
            out[f"{mode}_streams_per_step"] = round(counter.calls / steps, 2)
            toks[mode] = seqs
        from coli.model.batch import batch_graphs
        dec = batch_graphs(model)           # replayed batched steps (COLI_BATCH_GRAPHS=1 on the GPU), else None
        if dec is not None:
            out["batch_graph_replays"], out["batch_graph_captures"] = dec.replays, dec.captures
            out["batch_graph_eager_reason"] = dec.last_reason
        out["tokens_equal"] = toks["alone"] == toks["batch"]
        out["speedup"] = round(out["batch_tok_s"] / out["alone_tok_s"], 2)
        return {"batch": B, "steps": steps, **out}
    finally:
        model.experts = counter.inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "coli" / "demo" / "model"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=24)
    a = ap.parse_args()
    model, _ = load_model(a.model, a.device)
    routing = None
    if (Path(a.model) / "bench_trace.trace").is_file():     # a benchmark slice: route by its stored trace
        from coli.bench.trace_router import TraceRouting
        routing = TraceRouting(a.model).install(model)
    for B in (int(x) for x in a.batch.split(",")):
        print(json.dumps({"device": a.device, "trace": routing is not None,
                          **run(model, B, a.steps, a.prompt, routing=routing)}), flush=True)


if __name__ == "__main__":
    main()
