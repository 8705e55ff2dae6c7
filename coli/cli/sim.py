"""`coli sim`: expert-cache policy hit rates on routing traces (recorded or synthetic), with Belady
(clairvoyant) as the upper bound. The model of a cache is in coli/sim.py and docs/policy.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from coli.cli.common import clean_errors
from coli.errors import ColiError

DEFAULT_POLICIES = "lru,lfu,freq,rdf,slru,belady"
DEFAULT_SLOTS = "1,2,4,8,16,32,64"


def _ints(text: str, option: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ColiError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise ColiError(f"{option} needs non-negative integers, got {text!r}")
    return vals


def sim(
    trace: List[Path] = typer.Option([], "--trace", "-t", help="Routing trace file (repeatable)."),
    synth: Optional[str] = typer.Option(None, "--synth", help="Also simulate a synthetic trace: glm52 | uniform."),
    tokens: int = typer.Option(1000, "--tokens", min=1, help="Tokens of the synthetic trace."),
    layers: int = typer.Option(75, "--layers", min=1, help="MoE layers of the synthetic trace."),
    experts: int = typer.Option(256, "--experts", min=1, help="Experts per layer of the synthetic trace."),
    top_k: int = typer.Option(8, "--top-k", min=1, help="Experts per token of the synthetic trace."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic trace."),
    write_trace: Optional[Path] = typer.Option(None, "--write-trace", help="Save the synthetic trace to this file."),
    policy: str = typer.Option(DEFAULT_POLICIES, "--policy", "-p",
                               help="Comma-separated: lru, lfu, freq, rdf, slru, belady."),
    slots: str = typer.Option(DEFAULT_SLOTS, "--slots-per-layer", "-s", help="Comma-separated cache sizes per layer."),
    decay: float = typer.Option(0.9, "--decay", help="rdf: frequency decay per token, in [0, 1]."),
    protected: float = typer.Option(0.8, "--protected", help="slru: protected share of the slots."),
    count_decay: float = typer.Option(1.0, "--count-decay", help="lfu/freq: count decay per token, in (0, 1]."),
    shared: bool = typer.Option(False, "--shared", help="Also simulate one pool of slots x layers for all layers."),
    warmup: int = typer.Option(0, "--warmup", min=0, help="Tokens whose hits are not counted (cold start)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines instead of tables."),
) -> None:
    """Hit rate per policy and cache size; checks that Belady bounds every other policy."""
    _sim(trace, synth, tokens, layers, experts, top_k, seed, write_trace, policy, slots, decay, protected, shared,
         warmup, as_json, count_decay)


@clean_errors
def _sim(trace, synth, tokens, layers, experts, top_k, seed, write_trace, policy, slots, decay, protected, shared,
         warmup, as_json, count_decay=1.0):
    from coli import sim as S
    from coli.trace import read_trace, write_trace as save_trace
    from coli.traces_synth import generate

    pols = [p for p in policy.replace(" ", "").split(",") if p]
    bad = [p for p in pols if p not in S.POLICIES or p == "pinlru"]
    if bad:
        raise ColiError(f"unknown policy {bad[0]!r} (choose from lru, lfu, freq, rdf, slru, belady)")
    sizes = _ints(slots, "--slots-per-layer")
    if not trace and synth is None:
        raise ColiError("give --trace FILE (repeatable) or --synth glm52|uniform")

    inputs = []  # (name, idx, weights, n_experts)
    for path in trace:
        if not path.is_file():
            raise ColiError(f"trace {path} does not exist")
        tr = read_trace(path)
        if tr.n_tokens == 0:
            raise ColiError(f"trace {path} holds no complete token")
        inputs.append((str(path), tr.idx, tr.weights, tr.header.n_experts))
    if synth is not None:
        idx, w = generate(synth, tokens, layers, experts, top_k, seed)
        if write_trace is not None:
            save_trace(write_trace, idx, w, experts, meta={"generator": synth, "seed": seed})
        inputs.append((f"synth:{synth} T={tokens} L={layers} E={experts} K={top_k} seed={seed}", idx, w, experts))

    for name, idx, w, E in inputs:
        variants = [False, True] if shared else [False]
        for sh in variants:
            res = S.sweep(idx, pols, sizes, weights=w, n_experts=E, decay=decay, protected=protected, shared=sh,
                          count_decay=count_decay,
                          warmup=warmup)
            check = _belady_check(res)
            if as_json:
                for r in res:
                    print(json.dumps({"trace": name, **r.to_dict()}))
            else:
                T, L, K = idx.shape
                kind = "one shared pool of slots x layers" if sh else "per-layer caches"
                print(S.format_table(res, f"{name}: {T} tokens x {L} layers, top-{K} of {E}; {kind} "
                                          f"(hit rate; columns = slots per layer)"))
                if check is not None:
                    print(check)
                print()


def _belady_check(res) -> str | None:
    by = {}
    for r in res:
        by.setdefault(r.slots, {})[r.policy] = r.hits
    lines = []
    for s, d in by.items():
        if "belady" in d:
            worse = [p for p, h in d.items() if h > d["belady"]]
            if worse:
                lines.append(f"BOUND VIOLATED at {s} slots: {', '.join(worse)} beat belady")
    if not any("belady" in d for d in by.values()):
        return None
    return "\n".join(lines) if lines else "belady >= every other policy at every size: ok"


def register(app: typer.Typer) -> None:
    app.command("sim")(sim)
