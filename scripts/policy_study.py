#!/usr/bin/env python3
"""The expert-cache policy study of docs/policy.md: hit rate vs cache size for every policy on the glm52
synthetic trace, a uniform trace and routing traces recorded from the demo model; the rdf decay and slru
segment sweeps; the shared-pool variant; the RAM tier's pin set. Writes the tables between the markers
of docs/policy.md, docs/policy/hit_rate.png and docs/policy/results.json.

    .venv/bin/python scripts/policy_study.py            # ~3-5 min on one core
    .venv/bin/python scripts/policy_study.py --quick    # fewer tokens/layers, for a smoke run

The demo traces are recorded with `coli run --record-routing` (greedy, --ignore-eos) over the English
prompts below into docs/policy/demo.trace (reused if present; --rerecord to redo).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from coli import sim as S  # noqa: E402
from coli.trace import read_trace  # noqa: E402
from coli.traces_synth import GLM52_PARAMS, glm52, routing_stats, uniform  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "policy.md"
OUT = ROOT / "docs" / "policy"
DEMO = ROOT / "coli" / "demo" / "model"
PROMPTS = [
    "The os.path.join function",
    "Return a new list containing the items of the iterable",
    "What does itertools.chain do?",
    "The json module can be used to",
    "Hello! Who are you?",
    "This module provides functions for working with dates and times.",
    "Read the contents of a file and return them as a string.",
    "The quick brown fox jumps over the lazy dog.",
]
ONLINE = ["lru", "lfu", "freq", "rdf", "slru"]
ALL = ONLINE + ["belady"]


def record_demo(path: Path, tokens: int) -> None:
    path.unlink(missing_ok=True)
    coli = str(Path(sys.executable).with_name("coli"))
    for p in PROMPTS:
        subprocess.run([coli, "run", "--model", str(DEMO), "--prompt", p, "-n", str(tokens), "--ignore-eos",
                        "--record-routing", str(path)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def sweep_table(name, idx, w, E, sizes, pols=ALL, **kw):
    t0 = time.perf_counter()
    res = S.sweep(idx, pols, sizes, weights=w, n_experts=E, **kw)
    dt = time.perf_counter() - t0
    by = {(r.policy, r.slots): r for r in res}
    for s in sizes:  # the acceptance check, on every trace
        for p in pols:
            if p != "belady" and "belady" in pols:
                assert by[(p, s)].hits <= by[("belady", s)].hits, (name, p, s)
    print(f"{name}: {len(res)} runs in {dt:.1f} s", file=sys.stderr)
    return res, dt


def md_table(res, sizes, pols, best_marks=True) -> str:
    by = {(r.policy, r.slots): r.hit_rate for r in res}
    head = "| policy | " + " | ".join(str(s) for s in sizes) + " |"
    sep = "|---|" + "---:|" * len(sizes)
    rows = [head, sep]
    for p in pols:
        cells = []
        for s in sizes:
            v = by[(p, s)]
            best_online = max(by[(q, s)] for q in pols if q != "belady")
            mark = best_marks and p != "belady" and v == best_online
            cells.append(f"**{100 * v:.1f}**" if mark else f"{100 * v:.1f}")
        rows.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def pin_study(idx, E, train_tokens, cap_fracs, pin_fracs, vram_slots=0):
    """RAM tier: one pool over all layers, forced admission (every miss is read into a slot); pins are the
    most used keys of the first `train_tokens` tokens; hits counted on the rest."""
    T, L, K = idx.shape
    stream = idx
    if vram_slots:
        vr = S.simulate(idx, "lru", vram_slots, n_experts=E, record_hits=True)
        stream = S.miss_stream(idx, vr.hit_mask)
    rows = []
    for cf in cap_fracs:
        cap = max(1, int(round(cf * L * E)))
        row = {"capacity_share": cf, "capacity": cap}
        for pf in pin_fracs:
            pins = S.top_used_pins(stream[:train_tokens], int(pf * cap), E)
            r = S.simulate(stream, "pinlru", shared=True, capacity=cap, pins=pins, n_experts=E, warmup=train_tokens)
            row[f"pins {int(100 * pf)}%"] = r.hit_rate
        for p in ("freq", "belady"):
            row[p] = S.simulate(stream, p, shared=True, capacity=cap, n_experts=E, warmup=train_tokens).hit_rate
        rows.append(row)
    return rows


def pin_table(rows) -> str:
    keys = [k for k in rows[0] if k not in ("capacity_share", "capacity")]
    out = ["| RAM slots (share of all experts) | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for r in rows:
        best = max(r[k] for k in keys if k.startswith("pins"))
        cells = [(f"**{100 * r[k]:.1f}**" if k.startswith("pins") and r[k] == best else f"{100 * r[k]:.1f}")
                 for k in keys]
        out.append(f"| {r['capacity']} ({100 * r['capacity_share']:.0f} %) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(panels, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2))
    style = {"lru": "C0", "lfu": "C1", "freq": "C2", "rdf": "C3", "slru": "C4", "belady": "k"}
    for ax, (title, res, sizes) in zip(axes, panels):
        for p in ALL:
            ys = [100 * next(r.hit_rate for r in res if r.policy == p and r.slots == s) for s in sizes]
            ax.plot(sizes, ys, marker="o", ms=3, color=style[p], ls="--" if p == "belady" else "-",
                    label=p + (" (clairvoyant)" if p == "belady" else ""))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes], fontsize=7)
        ax.set_xlabel("slots per layer")
        ax.set_ylabel("hit rate (%)")
        ax.set_ylim(0, 100)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_pins(panels, pin_fracs, path) -> None:
    if path is None:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0))
    xs = [100 * f for f in pin_fracs]
    for ax, (title, rows) in zip(axes, panels):
        for i, r in enumerate(rows):
            ys = [100 * r[f"pins {int(100 * f)}%"] for f in pin_fracs]
            ax.plot(xs, ys, marker="o", ms=3, color=f"C{i}", label=f"{r['capacity']} slots ({100 * r['capacity_share']:.0f} %)")
            ax.axhline(100 * r["freq"], color=f"C{i}", ls=":", lw=1)
        ax.set_xlabel("pinned share of the RAM slots (%)")
        ax.set_ylabel("RAM-tier hit rate (%)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="dotted: freq", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_section(doc: Path, text: str) -> None:
    begin, end = "<!-- policy_study:begin -->", "<!-- policy_study:end -->"
    body = doc.read_text() if doc.exists() else f"# Expert cache policy\n\n{begin}\n{end}\n"
    if begin not in body or end not in body:
        raise SystemExit(f"{doc} lacks the markers {begin} / {end}")
    a, b = body.index(begin) + len(begin), body.index(end)
    doc.write_text(body[:a] + "\n" + text.rstrip() + "\n" + body[b:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=75)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--demo-tokens", type=int, default=96, help="new tokens per demo prompt")
    ap.add_argument("--rerecord", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.layers = 300, 8
    OUT.mkdir(parents=True, exist_ok=True)
    sections, results, panels = [], {}, []
    t_all = time.perf_counter()

    # ---- traces ---------------------------------------------------------------------------------
    g_idx, g_w = glm52(a.tokens, a.layers, seed=a.seed)
    u_idx, u_w = uniform(a.tokens, a.layers, seed=a.seed)
    demo_path = OUT / "demo.trace"
    if a.rerecord or not demo_path.exists():
        record_demo(demo_path, a.demo_tokens)
    demo = read_trace(demo_path)
    import hashlib
    demo_sha = hashlib.sha256((DEMO / "model.safetensors").read_bytes()).hexdigest()[:12]
    d_idx, d_w, dE = demo.idx, demo.weights, demo.header.n_experts
    stats = {"glm52": routing_stats(g_idx, 256), "uniform": routing_stats(u_idx, 256),
             "demo": routing_stats(d_idx, dE, window=75)}
    lines = ["### Traces", "",
             "| trace | tokens x MoE layers | experts, top-k | distinct experts in 75 tokens | top-4 share "
             "| shared with previous token |", "|---|---|---|---:|---:|---:|"]
    for name, (idx, E), st in (("glm52 (synthetic, seed %d)" % a.seed, (g_idx, 256), stats["glm52"]),
                               ("uniform (synthetic)", (u_idx, 256), stats["uniform"]),
                               ("demo model, %d prompts" % len(set(demo.seq.tolist())), (d_idx, dE), stats["demo"])):
        T, L, K = idx.shape
        lines.append(f"| {name} | {T} x {L} | {E}, {K} | {st['unique_in_window']:.1f} of {E} | "
                     f"{100 * st['top4_share']:.1f} % | {st['consecutive_shared']:.2f} of {K} |")
    sections.append("\n".join(lines))

    # ---- per-layer VRAM cache ---------------------------------------------------------------------
    g_sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192] if not a.quick else [1, 2, 4, 8, 16, 64]
    u_sizes = [1, 2, 4, 8, 16, 32, 64, 128] if not a.quick else [2, 8, 32]
    d_sizes = [1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16][:sum(1 for s in [1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16] if s <= dE)]
    g_res, g_dt = sweep_table("glm52", g_idx, g_w, 256, g_sizes)
    u_res, _ = sweep_table("uniform", u_idx, u_w, 256, u_sizes)
    d_res, _ = sweep_table("demo", d_idx, d_w, dE, d_sizes)
    T, L, K = g_idx.shape
    sections.append(
        f"### Per-layer caches: hit rate (%) by slots per layer\n\n"
        f"glm52, {T} tokens x {L} layers (bold: best non-clairvoyant; {len(g_res)} simulations took {g_dt:.0f} s "
        f"on one shared core):\n\n{md_table(g_res, g_sizes, ALL)}\n\n"
        f"uniform, {u_idx.shape[0]} tokens x {u_idx.shape[1]} layers:\n\n{md_table(u_res, u_sizes, ALL)}\n\n"
        f"demo model ({d_idx.shape[0]} tokens x {d_idx.shape[1]} layers, top-{d_idx.shape[2]} of {dE}):\n\n"
        f"{md_table(d_res, d_sizes, ALL)}")
    panels = [(f"glm52 synthetic ({T} tok x {L} layers, top-8 of 256)", g_res, g_sizes),
              (f"uniform ({u_idx.shape[0]} tok x {u_idx.shape[1]} layers)", u_res, u_sizes),
              (f"demo model ({d_idx.shape[0]} tok x {d_idx.shape[1]} layers, top-{d_idx.shape[2]} of {dE})",
               d_res, d_sizes)]
    results["per_layer"] = {"glm52": [r.to_dict() for r in g_res], "uniform": [r.to_dict() for r in u_res],
                            "demo": [r.to_dict() for r in d_res]}

    # ---- warm caches, rdf decay, slru segment at the GLM-5 operating point -----------------------------
    warm = min(200, T // 3)
    dw = d_idx.shape[0] // 4
    rows = ["| policy | glm52, 8 slots, first %d tokens not counted | demo, 4 slots, first %d not counted |" % (warm, dw),
            "|---|---:|---:|"]
    for p in ALL:
        gv = S.simulate(g_idx, p, 8, weights=g_w, n_experts=256, warmup=warm).hit_rate
        dv = S.simulate(d_idx, p, 4, weights=d_w, n_experts=dE, warmup=dw).hit_rate
        rows.append(f"| {p} | {100 * gv:.1f} | {100 * dv:.1f} |")
    sections.append("### Warm caches\n\n" + "\n".join(rows))
    rows = ["| rdf decay | glm52, 8 slots | glm52, 32 slots | demo, 4 slots | demo, 8 slots |", "|---|---:|---:|---:|---:|"]
    for dec in (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0):
        vals = [S.simulate(g_idx, "rdf", s, weights=g_w, n_experts=256, decay=dec).hit_rate for s in (8, 32)]
        vals += [S.simulate(d_idx, "rdf", s, weights=d_w, n_experts=dE, decay=dec).hit_rate for s in (4, 8)]
        rows.append(f"| {dec} | " + " | ".join(f"{100 * v:.1f}" for v in vals) + " |")
    rows2 = ["| slru protected share | glm52, 8 slots | glm52, 32 slots | demo, 4 slots | demo, 8 slots |",
             "|---|---:|---:|---:|---:|"]
    for pr in (0.25, 0.5, 0.8):
        vals = [S.simulate(g_idx, "slru", s, weights=g_w, n_experts=256, protected=pr).hit_rate for s in (8, 32)]
        vals += [S.simulate(d_idx, "slru", s, weights=d_w, n_experts=dE, protected=pr).hit_rate for s in (4, 8)]
        rows2.append(f"| {pr} | " + " | ".join(f"{100 * v:.1f}" for v in vals) + " |")
    sections.append("### rdf decay and slru segment\n\n" + "\n".join(rows) + "\n\n" + "\n".join(rows2))

    # ---- shared pool ---------------------------------------------------------------------------------
    sh_sizes = [2, 8, 32]
    sg, _ = sweep_table("glm52 shared", g_idx, g_w, 256, sh_sizes, shared=True)
    sd, _ = sweep_table("demo shared", d_idx, d_w, dE, [1, 2, 4], shared=True)
    sections.append("### One shared pool (slots per layer x layers, any layer may use any slot)\n\n"
                    f"glm52:\n\n{md_table(sg, sh_sizes, ALL)}\n\ndemo:\n\n{md_table(sd, [1, 2, 4], ALL)}")
    results["shared"] = {"glm52": [r.to_dict() for r in sg], "demo": [r.to_dict() for r in sd]}

    # ---- RAM tier pin set ------------------------------------------------------------------------------
    pin_fracs = (0.0, 0.25, 0.5, 0.75, 0.9)
    half = T // 2
    pg = pin_study(g_idx, 256, half, (0.05, 0.1, 0.25, 0.5), pin_fracs)
    pgv = pin_study(g_idx, 256, half, (0.05, 0.1, 0.25), pin_fracs, vram_slots=8)
    dseq = demo.seq
    d_train = int(np.searchsorted(dseq, np.unique(dseq)[len(np.unique(dseq)) // 2]))
    pd = pin_study(d_idx, dE, d_train, (0.375, 0.5, 0.75), pin_fracs)
    sections.append(
        "### RAM tier: LRU with a learned pin set\n\n"
        f"Hit rate (%) of the RAM tier's policy (`pinlru`: evict unpinned LRU first) with the pin set = the most "
        f"used experts of a first part of the trace (what `RamTierCore.top_used` persists between runs), "
        f"counted on the rest; `pins 0%` is plain LRU; `freq` and `belady` (one global pool) for scale.\n\n"
        f"glm52, every routed expert requested from the RAM tier (today's executor; pins learned on the "
        f"first {half} tokens):\n\n{pin_table(pg)}\n\n"
        f"glm52, only the misses of an 8-slot-per-layer LRU VRAM cache reach the RAM tier:\n\n{pin_table(pgv)}\n\n"
        f"demo model (pins learned on the first {len(np.unique(dseq)) // 2} prompts, counted on the others):\n\n"
        f"{pin_table(pd)}")
    results["ram_pins"] = {"glm52": pg, "glm52_behind_vram8": pgv, "demo": pd}

    plot_pins([("glm52: all routed experts reach the RAM tier", pg),
               ("glm52: behind an 8-slot/layer LRU VRAM cache", pgv), ("demo model", pd)], pin_fracs,
              None if a.no_write else OUT / "ram_pins.png")
    results["stats"] = stats
    results["glm52_params"] = GLM52_PARAMS
    results["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    results["demo_model_sha256"] = demo_sha
    text = (f"_Generated by `scripts/policy_study.py` (seed {a.seed}; demo model.safetensors sha256 {demo_sha}...; "
            f"demo trace docs/policy/demo.trace); {results['elapsed_s']:.0f} s on the dev VM._\n\n"
            + "\n\n".join(sections))
    if a.no_write:
        print(text)
        return 0
    plot(panels, OUT / "hit_rate.png")
    (OUT / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    write_section(DOC, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
