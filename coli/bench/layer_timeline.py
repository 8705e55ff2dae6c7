"""Where a streaming MoE layer's time goes beyond its copies, from the per-lane device timeline that `coli bench
stream` records (VramExperts.start_timeline: every demand copy's start/end events on its lane, the compute
stream's spans from the BusyClock marks, all in µs after one reference event on the compute stream).

Per MoE layer (pure; tests/bench/test_layer_timeline.py):

    route_to_copy_us   the router's top-k landed (end of the compute span marked "route": the segment's graph,
                       its top-k copy to pinned memory included) -> the layer's first copy starts on the demand
                       lane. The host's share: wake-up, the forward's Python, the expert source's bookkeeping.
    gaps_us            idle time between the layer's consecutive demand copies (issue slower than the bus)
    copy_us            the copies' own device time (what the bus needs; the floor of the layer)
    tail_us            the last copy landed -> the MoE kernels done (the end of the compute span marked
                       "moe_end"): the compute that only the last bytes hold back
    overhead_us        route_to_copy + gaps + tail: the MoE layer's time beyond its copies, link idle
    dense_us           the compute span that ends at this layer's router (the layer's attention, router, the
                       previous layer's shared expert and adds): the dense part, not the MoE layer's

Per token, `token_gap_us`: the head's span ends ("end": the argmax read back) -> the next compute span starts (the
next token's first graph): host time between tokens, charged to every layer of a 2-layer slice by the bench's
extrapolation although a real model pays it once per 78 layers.

A layer is a "route" span followed by the demand copies that start before the next "route"/"end" span does.
Layers without a demand copy (every expert a VRAM hit) are skipped: they have no copy phase to measure.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PHASES = ("route_to_copy_us", "gaps_us", "copy_us", "tail_us", "overhead_us", "dense_us")


def layer_phases(events: list[dict]) -> list[dict]:
    """events: {"lane": "demand" | "speculative" | "compute", "t0_us", "t1_us", "label"} -> one dict per MoE
    layer with the PHASES (µs) and its copy count."""
    ev = sorted(events, key=lambda e: (float(e["t0_us"]), float(e["t1_us"])))
    compute = [e for e in ev if e["lane"] == "compute"]
    demand = [e for e in ev if e["lane"] == "demand"]
    routes = [e for e in compute if e.get("label") == "route"]
    bounds = [e for e in compute if e.get("label") in ("route", "end")]
    out = []
    for r in routes:
        t_route = float(r["t1_us"])
        later = [float(b["t0_us"]) for b in bounds if float(b["t0_us"]) >= t_route]
        t_next = min(later) if later else float("inf")
        copies = [c for c in demand if t_route <= float(c["t0_us"]) < t_next]
        if not copies:
            continue
        first, last_end = float(copies[0]["t0_us"]), max(float(c["t1_us"]) for c in copies)
        busy = sum(float(c["t1_us"]) - float(c["t0_us"]) for c in copies)
        gaps = sum(max(0.0, float(b["t0_us"]) - float(a["t1_us"])) for a, b in zip(copies, copies[1:]))
        ends = [float(m["t1_us"]) for m in compute
                if m.get("label") == "moe_end" and last_end - 1e-6 <= float(m["t1_us"]) <= t_next + 1e-6]
        tail = (min(ends) - last_end) if ends else None
        row = {"route_to_copy_us": first - t_route, "gaps_us": gaps, "copy_us": busy, "tail_us": tail,
               "dense_us": float(r["t1_us"]) - float(r["t0_us"]), "copies": len(copies)}
        row["overhead_us"] = row["route_to_copy_us"] + gaps + (tail or 0.0)
        out.append(row)
    return out


def summarise_phases(events: list[dict]) -> dict[str, Any]:
    """Mean and p50 of each phase over the layers, the overhead as a fraction of the copy time, and the demand
    lane's busy time over the timeline's wall (first event start -> last event end)."""
    layers = layer_phases(events)
    res: dict[str, Any] = {"layers": len(layers)}
    for k in PHASES:
        v = [x[k] for x in layers if x[k] is not None]
        res[k] = {"mean": float(np.mean(v)), "p50": float(np.median(v))} if v else None
    if layers and res["copy_us"]["mean"]:
        res["overhead_over_copy"] = res["overhead_us"]["mean"] / res["copy_us"]["mean"]
    compute = sorted((e for e in events if e["lane"] == "compute"), key=lambda e: float(e["t0_us"]))
    gaps = [float(b["t0_us"]) - float(a["t1_us"]) for a, b in zip(compute, compute[1:]) if a.get("label") == "end"]
    res["token_gap_us"] = {"mean": float(np.mean(gaps)), "p50": float(np.median(gaps))} if gaps else None
    busy = [(float(e["t0_us"]), float(e["t1_us"])) for e in events if e["lane"] == "demand"]
    if busy:
        wall = max(float(e["t1_us"]) for e in events) - min(float(e["t0_us"]) for e in events)
        res["demand_busy_of_wall"] = sum(b - a for a, b in busy) / wall if wall > 0 else None
    return res
