"""`coli inspect DST`: formats, sizes per tier, experts per layer, bytes per token cold."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from coli.cli.common import clean_errors


def _b(n: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def inspect(
    model: Path = typer.Argument(..., help="Container directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show a container's formats, sizes per tier, record and tile layout, experts per layer and bytes per token."""
    _inspect(model, as_json)


@clean_errors
def _inspect(model, as_json):
    from rich.console import Console
    from rich.table import Table

    from coli.container.check import summarize

    s = summarize(model)
    if as_json:
        print(json.dumps(s, indent=1))
        return
    con = Console()
    f, t, mo, rec, cold = s["formats"], s["tiers"], s["model"], s["record"], s["bytes_per_token_cold"]
    con.print(f"[bold]{s['dir']}[/bold]  ColiStream container v{s['format_version']} ({s['writer']})")
    con.print(f"formats: experts [bold]{f['experts']}[/bold], dense core [bold]{f['dense']}[/bold] "
              f"({f['dense_kept_full_precision']} tensors kept f32), tiles {f['tile_kb']} KiB")
    con.print(f"model: {mo['layers']} layers ({mo['moe_layers']} MoE x {mo['experts_per_layer']} experts, "
              f"top-{mo['experts_per_token']}), hidden {mo['hidden']}, expert width {mo['moe_intermediate']}")
    tiers = Table(title="sizes per tier")
    tiers.add_column("tier")
    tiers.add_column("bytes", justify="right")
    tiers.add_column("detail")
    tiers.add_row("dense core", _b(t["dense_core_bytes"]),
                  ", ".join(f"{k}: {_b(v)}" for k, v in t["dense_core_by_format"].items()))
    tiers.add_row("expert store", _b(t["expert_store_bytes"]), f"{t['expert_files']} files")
    tiers.add_row("index", _b(t["index_bytes"]), "")
    con.print(tiers)
    rt = Table(title=f"expert record: {_b(rec['bytes'])} ({rec['bytes']} B; gate+up first {rec['gate_up_bytes']} B)")
    for col in ("matrix", "offset", "bytes", "tiles", "rows/tile", "tile bytes"):
        rt.add_column(col, justify="right" if col != "matrix" else "left")
    for name, m in rec["matrices"].items():
        rt.add_row(name, str(m["offset"]), str(m["bytes"]), str(m["tiles"]), str(m["rows_per_tile"]), str(m["tile_bytes"]))
    con.print(rt)
    lt = Table(title="experts per layer")
    lt.add_column("layer", justify="right")
    lt.add_column("experts", justify="right")
    lt.add_column("files")
    for row in s["experts_per_layer"]:
        lt.add_row(str(row["layer"]), str(row["experts"]), ", ".join(row["files"]))
    con.print(lt)
    mtp = s.get("mtp")
    con.print(f"MTP layer: layer {mtp['layer']}, dense {_b(mtp['dense_bytes'])}, {mtp['experts']} experts "
              f"{_b(mtp['expert_bytes'])}; a draft reads {_b(mtp['bytes_per_draft_cold'])} of experts cold"
              if mtp else "MTP layer: none (the checkpoint had none, or it was converted with --no-mtp): "
                          "`--mtp` cannot draft with this container")
    con.print(f"bytes per token, cold: routed {_b(cold['routed'])} ({cold['note']}); "
              f"{_b(cold['routed_plus_dense_core'])} if the dense core is streamed too")


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)
