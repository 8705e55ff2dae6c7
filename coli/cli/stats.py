"""`coli stats`: a live view (a few Hz) of each engine of a run, from the stats the supervisor
republishes; `--once --json` prints one snapshot."""

from __future__ import annotations

import json
import time

import typer
import zmq

from coli.cli.common import clean_errors


def stats(
    name: str = typer.Option("default", "--name", help="Run name."),
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    as_json: bool = typer.Option(False, "--json", help="JSON instead of a table (with --once)."),
    hz: float = typer.Option(4.0, "--hz", help="Refresh rate of the live view."),
) -> None:
    """Live view of the NVMe reader, RAM tier, copy lanes, SMs, fallbacks, tokens/s and latency."""
    _stats(name, once, as_json, hz)


@clean_errors
def _stats(name, once, as_json, hz):
    from rich.console import Console
    from rich.live import Live

    from coli.serve.client import Client
    from coli.protocol.messages import Stats
    from coli.protocol.sockets import make_socket, recv
    from coli.stats_view import render

    with Client(name) as c:
        snap = {k: v for k, v in c.status().get("stats", {}).items()}
        if once:
            if as_json:
                print(json.dumps(snap, indent=2))
            else:
                Console().print(render(snap, title=f"run {name}"))
            return
        sub = make_socket(c.ctx, zmq.SUB, c.rd.endpoint("stats"), bind=False, subscribe=[Stats], hwm=64)
        prev: dict = {}
        try:
            with Live(render(snap, title=f"run {name}"), refresh_per_second=hz, transient=False) as live:
                last = time.monotonic()
                while True:
                    if sub.poll(int(1000 / hz)):
                        msg = recv(sub)
                        old = snap.get(msg.stage)
                        if old is not None:
                            prev[msg.stage] = old
                        snap[msg.stage] = {"t": msg.t, **msg.counters}
                    if time.monotonic() - last >= 1 / hz:
                        live.update(render(snap, prev, title=f"run {name}"))
                        last = time.monotonic()
                    if not c.rd.is_live():
                        break
        except KeyboardInterrupt:
            pass
        finally:
            sub.close(linger=0)


def register(app: typer.Typer) -> None:
    app.command("stats")(stats)
