#!/usr/bin/env python3
"""MTP speculative decoding, measured: decode tok/s without drafts and with k = 1..3 and auto, in one run, on the same
prompts, plus the acceptance per draft position and tokens per step (greedy, so every mode yields the same tokens;
the script checks that).

    .venv/bin/python scripts/bench_mtp.py [--model DIR] [--device cpu|gpu] [--tokens 64] [--warmup-tokens 8]
                                          [--repeat 2] [--json OUT]

Prompts: chat questions about the demo model's held-out modules (training.json `modules_heldout`: never trained on)
plus a few about trained ones, in the demo's chat template. Timing is the decode part only (the prefill is the same
in every mode); each mode runs `--repeat` times and the best is kept (the machine is shared).

Steady state: a run's first decode steps pay what later ones do not -- the eager first step of a graph key and its
capture (on the GPU: thousands of nodes for a GLM-5 step; an MTP round's the same), the first MTP rounds -- so a
short run's ratio to `off` measures mostly that. Each run's tokens are timed one by one: the first
`--warmup-tokens` decode tokens are its warm-up, the rest its steady state, reported apart (`steady_*` keys; raise
`--tokens` to make the steady part long). Graph captures made during a mode's runs are counted (`captures`): with the
KV cache pool (coli/model/cache_pool.py) a repeat of a prompt captures nothing.

JSON (`--json`): model, device, backend, tokens, warmup_tokens, step_costs, prompts[group][question][mode] =
{decode_tokens_per_s, steady_tokens_per_s, warmup_s, mtp?}, modes[mode] = {decode_tokens_per_s, speedup_vs_off,
tokens_per_step, acceptance_per_position, steady_tokens_per_s, steady_speedup_vs_off, warmup_s (summed over the
prompts' best runs), captures (graphs captured during the mode's runs: decode steps + MTP rounds)}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "coli" / "demo" / "model"

HELDOUT = ["What does mimetypes.guess_type do?", "What is fractions.Fraction?", "Tell me about the pty module.",
           "What does code.interact do?", "Tell me about the modulefinder module.",
           "What does concurrent.futures.wait do?"]
TRAINED = ["What does os.path.join do?", "What does str.split do?", "Tell me about the json module."]


def run(model, head, ids, n, mode):
    """-> (tokens, GenerationStats, the perf_counter time each token came out)."""
    from coli.generate import Generation
    g = Generation(model, ids, n, ignore_eos=True, mtp=None if mode == "off" else (head, mode))
    toks, times = [], []
    for t in g:
        times.append(time.perf_counter())
        toks.append(t)
    return toks, g.stats, times


def split_steady(times: list[float], warmup: int) -> tuple[float, int, float]:
    """Token times [n] (token 0 from the prefill) -> (warm-up seconds: token 0 to token `warmup`, steady decode
    tokens after it, their seconds). A run of at most `warmup` + 1 tokens has no steady part: (its decode s, 0, 0)."""
    n = len(times)
    if n <= 1:
        return 0.0, 0, 0.0
    w = min(max(0, warmup), n - 1)
    return times[w] - times[0], n - 1 - w, times[-1] - times[w]


def graph_captures(model, head) -> int:
    """Graphs captured so far by the model's one-sequence decoder and the head's round graphs (0 without them)."""
    return sum(int(getattr(g, "captures", 0) or 0) for g in (model.step_graphs, head.rounds) if g is not None)


def step_costs(model, head, context: int = 64, reps: int = 30) -> dict:
    """Median seconds of a main step of S = 1..4 positions after `context` cached ones (a verify step of k drafts
    is S = k + 1) and of one MTP draft step, plus what they imply: tokens/s with k drafts at acceptance a (each
    draft kept with probability a, independently: E[tokens per step] = (1 - a^(k+1)) / (1 - a)) over plain decoding,
    and the break-even acceptance."""
    import numpy as np
    b = model.backend
    cache = model.new_cache(context + 8)
    ids = list(range(10, 10 + context))
    hn, _ = model.forward_hidden(ids, cache)
    mcache = head.new_cache(context + 8)
    head.step(ids[1:], b.rows(hn, context - 1), mcache)
    out = {}
    for S in (1, 2, 3, 4):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            h, lg = model.forward_hidden(ids[:S], cache)
            b.argmax(lg)
            ts.append(time.perf_counter() - t)
            cache.truncate(context)
        out[f"main_S{S}_s"] = float(np.median(ts))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        g, lg = head.step([5], b.last_row(hn), mcache)
        b.to_host(b.last_row(lg))
        ts.append(time.perf_counter() - t)
        mcache.truncate(context - 1)
    out["mtp_step_s"] = float(np.median(ts))
    # the cost model `coli bench stream --verify` applies to the GLM-5 slice (coli/bench/verify_step.py)
    from coli.bench.verify_step import ACCEPTANCES, break_even, round_s, speedup
    t1, tm = out["main_S1_s"], out["mtp_step_s"]
    # what decoding runs: a plain step through model.greedy (a replayed CUDA graph on the GPU) and, where the head
    # has them, a greedy one-draft round in its fixed shape (head.rounds: replayed from one graph on the GPU)
    tok = 5
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        model.greedy([tok], cache)
        ts.append(time.perf_counter() - t)
        cache.truncate(context)
    out["plain_step_s"] = float(np.median(ts))
    if head.rounds is not None:
        head.step([tok], b.row_range(hn, context - 1, 1), mcache)        # both caches at `context` positions
        mcache.truncate(context)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            head.rounds.round(tok, 7, cache, mcache)
            ts.append(time.perf_counter() - t)
            cache.truncate(context)
            mcache.truncate(context)
        out["row_round_s"] = float(np.median(ts))
        out["row_round_replays"] = getattr(head.rounds, "replays", None)
        out["row_round_last_reason"] = getattr(head.rounds, "last_reason", None)
        # a round of one draft yields 1 + a tokens at acceptance a (tokens_per_round with k = 1)
        out["row_round_speedup_at_acceptance"] = {
            str(a): round((1 + a) * out["plain_step_s"] / out["row_round_s"], 3) for a in ACCEPTANCES}
    for k in (1, 2, 3):
        tv = out[f"main_S{k + 1}_s"]
        be = break_even(k, t1, tv, tm)
        out[f"k{k}"] = {"round_s": round(round_s(tv, tm, k), 6),
                        "speedup_at_acceptance": {str(a): round(speedup(a, k, t1, tv, tm), 3) for a in ACCEPTANCES},
                        "break_even_acceptance": None if be is None else round(be, 3)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (raise it for a longer steady state)")
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="decode tokens at the start of each run reported as its warm-up, apart from the steady state")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", default="off,1,2,3,auto")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--costs-only", action="store_true", help="only the step costs and what they imply")
    a = ap.parse_args(argv)
    if a.tokens < 2 or a.warmup_tokens < 0:
        print(f"--tokens must be >= 2 and --warmup-tokens >= 0 (got {a.tokens}, {a.warmup_tokens})", file=sys.stderr)
        return 2

    from coli.chat_template import load_chat_template
    from coli.loader import load_model
    from coli.model.mtp import load_mtp_head
    from coli.tokenizer import load_tokenizer

    model, _ = load_model(a.model, a.device)
    head = load_mtp_head(model)
    tok, tpl = load_tokenizer(a.model), load_chat_template(a.model)
    modes = [m if m in ("off", "auto") else int(m) for m in a.modes.split(",")]
    costs = step_costs(model, head)
    print(json.dumps({"step_costs": costs}, indent=1), flush=True)
    if a.costs_only:
        if a.json:
            a.json.write_text(json.dumps({"step_costs": costs}, indent=1))
        return 0
    result = {"model": str(a.model), "device": a.device, "backend": model.backend.name, "tokens": a.tokens,
              "warmup_tokens": a.warmup_tokens, "step_costs": costs, "prompts": {}, "modes": {}}
    totals = {str(m): {"decode_s": 0.0, "tokens": 0, "rounds": 0, "drafted": [0, 0, 0], "accepted": [0, 0, 0],
                       "warmup_s": 0.0, "steady_s": 0.0, "steady_tokens": 0, "captures": 0}
              for m in modes}
    for group, qs in (("heldout", HELDOUT), ("trained", TRAINED)):
        for q in qs:
            ids = tok.encode(tpl.render([{"role": "user", "content": q}]))
            run(model, head, ids, 4, "off")                            # warm (graphs, caches)
            ref = None
            for m in modes:
                best, best_split = None, None
                captured = graph_captures(model, head)
                for _ in range(a.repeat):
                    toks, st, times = run(model, head, ids, a.tokens, m)
                    if ref is None:
                        ref = toks
                    if toks != ref:
                        print(f"MISMATCH: mode {m} on {q!r}", file=sys.stderr)
                        return 1
                    if best is None or st.decode_s < best.decode_s:
                        best = st
                    sp = split_steady(times, a.warmup_tokens)
                    if sp[1] and (best_split is None or sp[2] / sp[1] < best_split[2] / best_split[1]):
                        best_split = sp            # the best steady rate of the repeats (the machine is shared)
                    elif best_split is None and not sp[1]:
                        best_split = sp
                t = totals[str(m)]
                t["captures"] += graph_captures(model, head) - captured
                w_s, s_n, s_s = best_split
                t["warmup_s"] += w_s
                t["steady_tokens"] += s_n
                t["steady_s"] += s_s
                t["decode_s"] += best.decode_s
                t["tokens"] += best.new_tokens - 1
                if best.mtp:
                    t["rounds"] += best.mtp["rounds"]
                    for j, (d, c) in enumerate(zip(best.mtp["drafted"], best.mtp["accepted"])):
                        t["drafted"][j] += d
                        t["accepted"][j] += c
                result["prompts"].setdefault(group, {}).setdefault(q, {})[str(m)] = {
                    "decode_tokens_per_s": round(best.decode_tps, 2),
                    "steady_tokens_per_s": round(s_n / s_s, 2) if s_s > 0 else None, "warmup_s": round(w_s, 6),
                    **({"mtp": best.mtp} if best.mtp else {})}
            row = result["prompts"][group][q]
            print(f"{group:8s} {q[:40]:40s} " + "  ".join(
                f"{m}: {row[str(m)]['decode_tokens_per_s']:7.1f} (steady {row[str(m)]['steady_tokens_per_s'] or 0:7.1f})"
                for m in modes), flush=True)
    base = totals["off"]["tokens"] / totals["off"]["decode_s"] if "off" in totals else None

    def steady(t):
        return t["steady_tokens"] / t["steady_s"] if t["steady_s"] > 0 else None

    steady_base = steady(totals["off"]) if "off" in totals else None
    for m, t in totals.items():
        tps = t["tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        sps = steady(t)
        result["modes"][m] = {"decode_tokens_per_s": round(tps, 2),
                              "speedup_vs_off": round(tps / base, 3) if base else None,
                              "tokens_per_step": round((t["tokens"] + 0) / t["rounds"], 3) if t["rounds"] else None,
                              "acceptance_per_position": [round(c / d, 3) if d else None
                                                          for d, c in zip(t["drafted"], t["accepted"])],
                              "steady_tokens_per_s": round(sps, 2) if sps else None,
                              "steady_speedup_vs_off": round(sps / steady_base, 3) if sps and steady_base else None,
                              "warmup_s": round(t["warmup_s"], 6), "captures": t["captures"]}
    print(json.dumps(result["modes"], indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
