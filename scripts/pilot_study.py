#!/usr/bin/env python3
"""The router-lookahead pilot study of docs/pilot.md (issue 7): recall@k of the pilot's predictions on
the trained demo model, per target layer, for both variants ("pre": layer l's post-attention residual
stream; "shared": plus layer l's shared-expert output) and N = 1, 2 layers ahead, against a naive
baseline (layer t uses the experts it used for the previous token), and the wasted bytes per useful
byte a prefetch of the predictions would read. Writes docs/pilot/recall.json.

    .venv/bin/python scripts/pilot_study.py                 # ~30 s on one core
    .venv/bin/python scripts/pilot_study.py --runtime       # also: decode tokens/s of `coli up` pilot off vs on

The model runs in-process (numpy backend) over the English chat prompts below (the demo's tokenizer and
chat template), greedy, --ignore-eos.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from coli.chat_template import load_chat_template  # noqa: E402
from coli.generate import Generation  # noqa: E402
from coli.loader import load_model  # noqa: E402
from coli.model.sampling import SamplingParams  # noqa: E402
from coli.pilot import VARIANTS, predict, recall_at_k, target_layer  # noqa: E402
from coli.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "coli" / "demo" / "model"
OUT = ROOT / "docs" / "pilot"
PROMPTS = [
    "What does the os.path.join function do?",
    "Write a Python function that returns the largest item of a list.",
    "What does itertools.chain do?",
    "How do I read a JSON file in Python?",
    "Hello! Who are you?",
    "Explain what a dictionary is in Python.",
    "How can I sort a list of strings by length?",
    "What is the difference between a list and a tuple?",
]
AHEAD = (1, 2)


class Probe:
    """routing_hook + pilot_hook of one forward call: the actual routing of every MoE layer and the
    pilot's predictions of every (variant, N, target)."""

    def __init__(self, model):
        self.model = model
        self.actual: dict[int, np.ndarray] = {}
        self.pred: dict[tuple[str, int, int], np.ndarray] = {}

    def routing(self, layer, idx, w):
        self.actual[layer] = np.array(idx)

    def pilot(self, layer, h, side):
        for n in AHEAD:
            t = target_layer(self.model, layer, n)
            if t is None:
                continue
            for v in VARIANTS:
                self.pred[(v, n, t)] = predict(self.model, t, h, side if v == "shared" else None)


def collect(tokens_per_prompt: int):
    model, cfg = load_model(DEMO)
    tok, tpl = load_tokenizer(DEMO), load_chat_template(DEMO)
    seqs = []  # per prompt: actual [P, L_moe...] dict layer -> [P, K], pred dict -> [P, K], decode mask [P]
    for text in PROMPTS:
        ids = tok.encode(tpl.render([{"role": "user", "content": text}], add_generation_prompt=True))
        rows: list[Probe] = []

        def fresh():
            p = Probe(model)
            rows.append(p)
            model.routing_hook, model.pilot_hook = p.routing, p.pilot

        orig_forward = model.forward

        def forward(ids_, cache, all_logits=False):
            fresh()
            return orig_forward(ids_, cache, all_logits)

        model.forward = forward
        gen = Generation(model, ids, tokens_per_prompt, SamplingParams(greedy=True), eos_ids=cfg.eos_token_ids,
                         ignore_eos=True)
        out = list(gen)
        del model.forward
        model.routing_hook = model.pilot_hook = None
        actual = {l: np.concatenate([r.actual[l] for r in rows]) for l in rows[0].actual}
        pred = {k: np.concatenate([r.pred[k] for r in rows]) for k in rows[0].pred}
        decode = np.zeros(len(actual[next(iter(actual))]), bool)
        decode[len(ids):] = True
        seqs.append({"prompt": text, "prompt_tokens": len(ids), "generated": tok.decode(out), "actual": actual,
                     "pred": pred, "decode": decode})
    return model, cfg, seqs


def study(model, cfg, seqs) -> dict:
    K = cfg.num_experts_per_tok
    E = cfg.n_routed_experts
    rec_bytes = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4  # the demo's f32 expert record (gate, up, down)
    moe_layers = sorted(seqs[0]["actual"])
    res = {"model": "coli/demo/model", "k": K, "experts": E, "expert_record_bytes": rec_bytes,
           "prompts": len(seqs), "positions": int(sum(len(s["decode"]) for s in seqs)),
           "decode_positions": int(sum(s["decode"].sum() for s in seqs)), "methods": {}}

    def agg(scope: str, get):
        """get(seq) -> (pred [P, K], actual [P, K], valid mask [P]) for one target layer."""
        r, hits, n = [], 0.0, 0
        for s in seqs:
            pred, act, valid = get(s)
            m = valid & (s["decode"] if scope == "decode" else np.ones_like(valid))
            if m.any():
                rr = recall_at_k(pred[m], act[m])
                r.append(rr)
        r = np.concatenate(r)
        useful = float(r.sum() * K)          # predicted experts the token used
        wasted = float(len(r) * K - useful)  # predicted experts it did not use
        return {"recall": float(r.mean()), "rows": int(len(r)), "wasted_per_useful": wasted / useful if useful else None}

    for scope in ("decode", "all"):
        out = {}
        for v in VARIANTS:
            for n in AHEAD:
                per = {}
                for t in moe_layers:
                    if (v, n, t) not in seqs[0]["pred"]:
                        continue
                    per[t] = agg(scope, lambda s, t=t: (s["pred"][(v, n, t)], s["actual"][t],
                                                        np.ones(len(s["decode"]), bool)))
                out[f"pilot-{v}-N{n}"] = per
        # baseline: layer t uses the experts it used for the previous position (first position: no guess)
        per = {}
        for t in moe_layers:
            def base(s, t=t):
                a = s["actual"][t]
                prev = np.concatenate([a[:1], a[:-1]])
                valid = np.ones(len(a), bool)
                valid[0] = False
                return prev, a, valid
            per[t] = agg(scope, base)
        out["baseline-previous-token"] = per
        for name, blk in out.items():
            rows = sum(x["rows"] for x in blk.values())
            rec = sum(x["recall"] * x["rows"] for x in blk.values()) / rows
            useful = rec * rows * K
            blk["overall"] = {"recall": rec, "rows": rows, "wasted_per_useful": (rows * K - useful) / useful}
        res["methods"][scope] = {name: {str(k): v for k, v in blk.items()} for name, blk in out.items()}
    res["samples"] = [{"prompt": s["prompt"], "prompt_tokens": s["prompt_tokens"], "generated": s["generated"]}
                      for s in seqs[:3]]
    return res


# ---- runtime: coli up --pilot off vs on ----------------------------------------------------------------------
def runtime_bench(tokens: int, ram_gb: float, repeats: int, modes=("off", "on", "2"), device: str = "cpu",
                  vram_slots: int | None = None) -> dict:
    import shutil
    import tempfile

    coli = str(Path(sys.executable).with_name("coli"))
    base = Path(tempfile.mkdtemp(prefix="colip-", dir="/tmp"))
    env = dict(os.environ, COLI_RUN_DIR=str(base / "runs"), COLI_CACHE=str(base / "cache"),
               OMP_NUM_THREADS="1")
    out = {"ram_gb": ram_gb, "tokens_per_request": tokens, "prompts": len(PROMPTS), "repeats": repeats, "modes": {},
           "device": device, "vram_slots": vram_slots}
    gpu_args = ["--device", device] + (["--vram-slots", str(vram_slots)] if vram_slots else [])
    try:
        for mode in modes:
            name = f"pilot{mode}"
            for u in (base / "cache").rglob("coli-usage.json"):  # no learned pin set carried between modes
                u.unlink()
            r = subprocess.run([coli, "up", "--name", name, "--ram-gb", str(ram_gb), "--detach", "--pilot", mode,
                                "--startup-timeout", "120", *gpu_args], env=env, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr + r.stdout
            try:
                dec_s, n_tok, toks = 0.0, 0, []
                for rep in range(repeats):
                    for p in PROMPTS:
                        c = subprocess.run([coli, "chat", "--name", name, "--greedy", "--ignore-eos", "--max-tokens",
                                            str(tokens), "--json", "--prompt", p], env=env, capture_output=True, text=True)
                        assert c.returncode == 0, c.stderr
                        d = json.loads(c.stdout)
                        t = d.get("stats") or {}
                        toks.append(d["tokens"])
                        if rep > 0 or repeats == 1:
                            dec_s += t.get("decode_s", 0.0)
                            n_tok += len(d["tokens"]) - 1
                time.sleep(1.2)  # stats are published every 0.5 s
                st = json.loads(subprocess.run([coli, "stats", "--name", name, "--once", "--json"], env=env,
                                               capture_output=True, text=True).stdout)
                status = json.loads(subprocess.run([coli, "status", "--name", name, "--json"], env=env,
                                                   capture_output=True, text=True).stdout)
            finally:
                subprocess.run([coli, "down", "--name", name], env=env, capture_output=True)
            ex, rt = st.get("executor", {}), st.get("ramtier", {})
            out["modes"][mode] = {
                "decode_tokens_per_s": n_tok / dec_s if dec_s else None, "decode_tokens": n_tok,
                "ram_slots": status.get("ram_slots"), "tokens": toks,
                "executor": {k: ex.get(k) for k in ("pilot_predicted", "pilot_hits", "wait_s", "expert_requests",
                                                     "vram_hit_rate", "hits", "misses", "spec_loads", "spec_used",
                                                     "spec_wasted", "spec_copies", "spec_cancelled", "stale_copies",
                                                     "copies", "cpu_fallbacks") if k in ex},
                "ramtier": {k: rt.get(k) for k in ("hits", "misses", "hit_rate", "prefetch_hits", "evictions",
                                                    "reads_issued", "read_bytes")},
            }
            print(mode, json.dumps({k: v for k, v in out["modes"][mode].items() if k != "tokens"}), flush=True)
        first = out["modes"][modes[0]]["tokens"]
        out["tokens_equal_across_modes"] = all(m["tokens"] == first for m in out["modes"].values())
        for m in out["modes"].values():
            del m["tokens"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--runtime", action="store_true", help="also measure `coli up` decode tokens/s pilot off vs on")
    ap.add_argument("--runtime-only", action="store_true")
    ap.add_argument("--ram-gb", type=float, default=0.0012, help="RAM tier for --runtime (0.0012 GB: ~8 slots)")
    ap.add_argument("--repeats", type=int, default=3, help="--runtime: passes over the prompts (first is warm-up)")
    ap.add_argument("--modes", default="off,on,2", help="--runtime: --pilot values to run, in this order")
    ap.add_argument("--runtime-out", default="runtime.json", help="--runtime: file name under docs/pilot/")
    ap.add_argument("--device", default="cpu", help="--runtime: coli up --device (gpu: the VRAM cache + speculative lane)")
    ap.add_argument("--vram-slots", type=int, default=None, help="--runtime on the GPU: VRAM expert slots")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not a.runtime_only:
        t0 = time.perf_counter()
        model, cfg, seqs = collect(a.tokens)
        res = study(model, cfg, seqs)
        res["elapsed_s"] = round(time.perf_counter() - t0, 1)
        res["tokens_per_prompt"] = a.tokens
        (OUT / "recall.json").write_text(json.dumps(res, indent=1) + "\n")
        for scope, methods in res["methods"].items():
            print(f"[{scope}]")
            for name, blk in methods.items():
                print(f"  {name:28s} " + "  ".join(f"L{t}={x['recall']:.3f}" for t, x in blk.items() if t != "overall")
                      + f"  overall={blk['overall']['recall']:.3f} waste/useful={blk['overall']['wasted_per_useful']:.2f}")
    if a.runtime or a.runtime_only:
        rt = runtime_bench(a.tokens, a.ram_gb, a.repeats, tuple(a.modes.split(",")), a.device, a.vram_slots)
        rt["hardware"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version()}
        try:
            rt["hardware"]["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                         if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        (OUT / a.runtime_out).write_text(json.dumps(rt, indent=1) + "\n")


if __name__ == "__main__":
    main()
