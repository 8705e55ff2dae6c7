"""PNG figures for `coli bench` reports (matplotlib, Agg backend; imported inside each function).

    plot_h2d_tiles(ceil, path)      h2d_peak's result: GB/s per tile size (back-to-back tiles) against the whole-buffer
                                    peak, and the single-tile transfer time in µs on a second axis
    plot_timeline(events, path)     one horizontal lane per kind ("demand", "speculative", "compute"), a bar per event
                                    {"lane", "t0_us", "t1_us", "label"}; labels drawn inside bars wide enough for them
    plot_scenarios(rows, path)      tokens/s per row {"name", "tokens_per_s", "ceiling_tokens_per_s"?, "baseline"?}:
                                    a bar per scenario with its ceiling as a marker; baselines (baseline: true) hatched
                                    grey, without ceiling

matplotlib is the `[bench]` extra (also in `[dev]`), not a base dependency: nothing at run time draws. Without it
every function raises PlotsUnavailable, naming it and how to install it (the bench says so once and skips plots).
Each returns the path written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coli.errors import ColiError

LANES = ("demand", "speculative", "compute")
_LANE_COLOURS = {"demand": "#d62728", "speculative": "#1f77b4", "compute": "#2ca02c"}


INSTALL_HINT = "pip install -e '.[bench]', or pip install matplotlib"


class PlotsUnavailable(ColiError):
    """matplotlib is not installed (the `[bench]` extra); the plots are skipped."""


def missing() -> str | None:
    """Why plots cannot be drawn here (matplotlib absent, with the install line), or None when they can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed ({INSTALL_HINT}): no plots written"
    return None


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(f"matplotlib is not installed ({INSTALL_HINT}): no plots written") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def plot_h2d_tiles(ceil: dict[str, Any], path: str | Path) -> Path:
    """GB/s of back-to-back tiles per tile size (log2 x axis), the whole-buffer peak as a line, tile µs on the right."""
    tiles = ceil.get("tiles") or {}
    if not tiles:
        raise ValueError("plot_h2d_tiles: the ceiling has no 'tiles' (an h2d_peak result is expected)")
    plt = _pyplot()
    kbs = sorted(int(k) for k in tiles)
    row = {int(k): v for k, v in tiles.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(kbs, [row[k]["GBps"] for k in kbs], "o-", color="#1f77b4", label="back-to-back tiles (GB/s)")
    if ceil.get("whole_GBps"):
        ax.axhline(ceil["whole_GBps"], color="#1f77b4", ls="--", lw=1,
                   label=f"whole buffer {ceil['whole_GBps']:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(kbs)
    ax.set_xticklabels([f"{k // 1024} MiB" if k >= 1024 else f"{k} KiB" for k in kbs], rotation=30)
    ax.set_xlabel("tile size")
    ax.set_ylabel("GB/s (pinned H2D)")
    ax.set_ylim(bottom=0)
    if all("tile_us" in row[k] for k in kbs):
        ax2 = ax.twinx()
        ax2.plot(kbs, [row[k]["tile_us"] for k in kbs], "s:", color="#ff7f0e", label="one tile (µs)")
        ax2.set_yscale("log")
        ax2.set_ylabel("single-tile transfer time (µs)")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    else:
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Pinned host-to-device copy peak")
    return _save(fig, path)


def plot_timeline(events: list[dict[str, Any]], path: str | Path, title: str = "Copy and compute lanes") -> Path:
    """A horizontal lane per kind (demand, speculative, compute, then any other lane named), a bar per event."""
    if not events:
        raise ValueError("plot_timeline: no events")
    for i, e in enumerate(events):
        missing = {"lane", "t0_us", "t1_us"} - set(e)
        if missing:
            raise ValueError(f"plot_timeline: event {i} lacks {sorted(missing)}: {e}")
        if e["t1_us"] < e["t0_us"]:
            raise ValueError(f"plot_timeline: event {i} ends before it starts: {e}")
    plt = _pyplot()
    lanes = [l for l in LANES if any(e["lane"] == l for e in events)]
    lanes += sorted({e["lane"] for e in events} - set(lanes))
    y = {l: i for i, l in enumerate(reversed(lanes))}
    t_min = min(e["t0_us"] for e in events)
    t_max = max(e["t1_us"] for e in events)
    span = max(t_max - t_min, 1e-9)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(lanes)))
    for l in lanes:
        ev = [e for e in events if e["lane"] == l]
        ax.broken_barh([(e["t0_us"] - t_min, max(e["t1_us"] - e["t0_us"], span * 1e-4)) for e in ev],
                       (y[l] - 0.35, 0.7), facecolors=_LANE_COLOURS.get(l, "#7f7f7f"), edgecolor="white", lw=0.3)
        for e in ev:
            lab = str(e.get("label") or "")
            w = e["t1_us"] - e["t0_us"]
            if lab and w >= span * 0.012 * max(len(lab), 1):      # only where the label fits
                ax.text(e["t0_us"] - t_min + w / 2, y[l], lab, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([y[l] for l in lanes])
    ax.set_yticklabels(lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"µs from {t_min:.0f} µs")
    ax.set_title(title)
    return _save(fig, path)


def plot_scenarios(rows: list[dict[str, Any]], path: str | Path, title: str = "Decode tokens/s") -> Path:
    """A bar per row (tokens/s), its ceiling (ceiling_tokens_per_s) as a black marker; baseline rows hatched grey.
    A row's tokens_per_s may be None (it failed): drawn as an empty slot labelled 'n/a'."""
    if not rows:
        raise ValueError("plot_scenarios: no rows")
    for i, r in enumerate(rows):
        if "name" not in r or "tokens_per_s" not in r:
            raise ValueError(f"plot_scenarios: row {i} needs 'name' and 'tokens_per_s': {r}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    xs = list(range(len(rows)))
    ceiling_drawn = False
    top = 0.0
    labels: list[tuple[int, float]] = []
    for x, r in zip(xs, rows):
        v = r["tokens_per_s"]
        base = bool(r.get("baseline"))
        if v is None:
            ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
        else:
            ax.bar(x, v, width=0.6, color="#bbbbbb" if base else "#1f77b4", hatch="//" if base else None,
                   edgecolor="#555555" if base else None)
            labels.append((x, v))
            top = max(top, v)
        c = r.get("ceiling_tokens_per_s")
        if c is not None and not base:
            ax.plot([x - 0.3, x + 0.3], [c, c], color="black", lw=2,
                    label=None if ceiling_drawn else "ceiling (copy peak)")
            ax.plot([x], [c], "kv", ms=5)
            ceiling_drawn = True
            top = max(top, c)
    for x, v in labels:            # inside tall bars (a ceiling marker may sit just above), above short ones
        inside = v > 0.25 * top
        ax.text(x, v * 0.97 if inside else v, f"{v:.2f}", ha="center", va="top" if inside else "bottom", fontsize=8,
                color="white" if inside and not rows[x].get("baseline") else "black")
    if any(r.get("baseline") for r in rows):
        ax.bar([0], [0], color="#bbbbbb", hatch="//", edgecolor="#555555", label="baseline")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(r["name"]) for r in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_title(title)
    if ceiling_drawn or any(r.get("baseline") for r in rows):
        ax.legend(fontsize=8)
    return _save(fig, path)
