"""`coli ps`: every run under the run base — name, state, supervisor pid, model, uptime, HTTP address —
read from the run directories alone (a run that is down answers no socket)."""

from __future__ import annotations

import json
import time

import typer

from coli.cli.common import clean_errors


def describe_runs(base=None) -> list[dict]:
    """One dict per run directory: name, state (starting | ready | stopped | dead), pid, model, http,
    uptime_s (up) or stopped_s_ago (stopped), reason (stopped or dead)."""
    from coli.protocol.errors import RunDirError
    from coli.protocol.rundir import RunDir, _alive, default_base

    root = default_base() if base is None else base
    out = []
    if not root.is_dir():
        return out
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            continue
        try:
            rd = RunDir(entry.name, root, create=False)
            rec, st = rd.read_pid(), rd.read_state() or {}
        except RunDirError as e:
            out.append({"name": entry.name, "state": "unreadable", "reason": str(e)})
            continue
        row = {"name": entry.name, "model": st.get("model"), "http": st.get("http"), "pid": None}
        if rec is not None and _alive(*rec):
            row.update(state=st.get("state", "starting"), pid=rec[0],
                       uptime_s=round(time.time() - st["started"], 1) if "started" in st else None)
        elif rec is not None:
            row.update(state="dead", pid=rec[0], reason=f"supervisor pid {rec[0]} died; `coli down --name "
                                                       f"{entry.name}` cleans up")
        elif st.get("state") == "stopped":
            row.update(state="stopped", reason=st.get("reason"), failed=st.get("failed", False),
                       stopped_s_ago=round(time.time() - st.get("stopped", time.time()), 1))
        else:
            row.update(state="stopped")
        out.append(row)
    return out


def ps(as_json: bool = typer.Option(False, "--json", help="Print a JSON list."),
       up_only: bool = typer.Option(False, "--up", help="Only runs that are up (starting or ready).")) -> None:
    """List every run: name, state, supervisor pid, model, uptime, HTTP address."""
    _ps(as_json, up_only)


@clean_errors
def _ps(as_json, up_only):
    from rich.console import Console
    from rich.table import Table

    from coli.serve.client import ago

    runs = [r for r in describe_runs() if not up_only or r["state"] in ("starting", "ready")]
    if as_json:
        print(json.dumps(runs, indent=2))
        return
    con = Console(highlight=False)
    if not runs:
        con.print("no runs (start one with `coli up`)")
        return
    t = Table("name", "state", "pid", "model", "uptime", "http", show_edge=False, pad_edge=False)
    for r in runs:
        if r.get("uptime_s") is not None:
            since = ago(time.time() - r["uptime_s"])
        elif r.get("stopped_s_ago") is not None:
            since = f"stopped {ago(time.time() - r['stopped_s_ago'])} ago"
        else:
            since = "-"
        state = r["state"] + (" (failed)" if r.get("failed") else "")
        t.add_row(r["name"], state, str(r.get("pid") or "-"), str(r.get("model") or "-"), since, r.get("http") or "-")
    con.print(t)


def register(app: typer.Typer) -> None:
    app.command("ps")(ps)
