"""`coli stats`: a live view (a few Hz) of each engine of a run, from the stats the supervisor
republishes; `--json` streams one JSON snapshot a line at --hz, `--once` prints one and exits."""

from __future__ import annotations

import json
import time

import typer
import zmq

from coli.cli.common import clean_errors
from coli.errors import ColiError

MAX_HZ = 50.0


def stats(
    name: str = typer.Option("default", "--name", help="Run name."),
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    as_json: bool = typer.Option(False, "--json", help="JSON instead of a table: one snapshot per line at --hz "
                                                       "(with --once: one, indented)."),
    hz: float = typer.Option(4.0, "--hz", help=f"Refreshes (or JSON lines) per second, in (0, {MAX_HZ:g}]."),
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

    if not 0 < hz <= MAX_HZ:
        raise ColiError(f"--hz {hz:g}: the refresh rate must be in (0, {MAX_HZ:g}] per second")
    with Client(name) as c:
        device = c.info.get("device")
        snap = {k: v for k, v in c.status().get("stats", {}).items()}
        if once:
            if as_json:
                print(json.dumps(snap, indent=2))
            else:
                Console().print(render(snap, title=f"run {name}", device=device))
            return
        sub = make_socket(c.ctx, zmq.SUB, c.rd.endpoint("stats"), bind=False, subscribe=[Stats], hwm=64)
        prev: dict = {}
        period = 1.0 / hz

        def take(msg) -> None:
            old = snap.get(msg.stage)
            if old is not None:
                prev[msg.stage] = old
            snap[msg.stage] = {"t": msg.t, **msg.counters}

        def updates():
            """Yields at every period until the run goes away, having taken every message meanwhile."""
            last = time.monotonic() - period
            while c.rd.is_live():
                if time.monotonic() - last >= period:
                    last = time.monotonic()
                    yield
                if sub.poll(max(1, int((last + period - time.monotonic()) * 1000))):
                    while True:
                        try:
                            take(recv(sub, flags=zmq.NOBLOCK))
                        except zmq.Again:
                            break

        try:
            if as_json:  # a line per period, at once: a pipe (jq, a logger) sees each as it comes
                for _ in updates():
                    print(json.dumps({"t": time.time(), **snap}), flush=True)
            else:
                with Live(render(snap, title=f"run {name}", device=device), refresh_per_second=hz,
                          transient=False) as live:
                    for _ in updates():
                        live.update(render(snap, prev, title=f"run {name}", device=device))
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # `coli stats --json | head`
            pass
        finally:
            sub.close(linger=0)


def register(app: typer.Typer) -> None:
    app.command("stats")(stats)
