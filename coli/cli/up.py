"""`coli up`, `coli down`, `coli status`: start, stop and describe a run of stage processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from coli.cli.common import clean_errors, fail
from coli.errors import ColiError
from coli.stages.executor.batch_defaults import DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS

LOG_LEVELS = ("debug", "info", "warning", "error")


def up(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Container, Hugging Face checkpoint, or a name "
                                         "`coli models` lists (ORG/REPO from `coli pull`); default: the built-in demo model."),
    name: str = typer.Option("default", "--name", help="Run name (several runs can be up at once)."),
    ram_gb: float = typer.Option(4.0, "--ram-gb", help="RAM tier budget for expert slots, in GB."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | gpu."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Start in the background and return once the run is ready."),
    startup_timeout: float = typer.Option(120.0, "--startup-timeout", help="Seconds each stage gets to become ready."),
    stage_timeout: float = typer.Option(5.0, "--stage-timeout", min=0.5,
                                        help="Seconds a ready stage may send no heartbeat before it is called "
                                             "unresponsive: its requests fail naming it, `coli status` says so."),
    reader_threads: int = typer.Option(4, "--reader-threads", min=1, help="NVMe reader threads."),
    queue_depth: int = typer.Option(16, "--queue-depth", min=1, help="Reads in flight at most."),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error."),
    http: Optional[str] = typer.Option(None, "--http", help="Also serve the OpenAI-compatible HTTP API on [HOST:]PORT "
                                       "(`coli serve` beside the run; API key from COLI_API_KEY or --api-key-file)."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", help="With --http: read the gateway's API key "
                                                "from this file (first line, chmod 600) instead of COLI_API_KEY."),
    record_routing: Optional[Path] = typer.Option(None, "--record-routing", metavar="FILE",
                                                  help="Append every token's routed experts and weights to FILE "
                                                       "(docs/traces.md; read it with `coli sim --trace FILE`)."),
    vram_gb: Optional[float] = typer.Option(None, "--vram-gb", min=0.0,
                                            help="GPU: budget for the dense core, KV cache, workspaces and the VRAM "
                                                 "expert slots, in GB (default: every expert resident in VRAM)."),
    vram_slots: Optional[int] = typer.Option(None, "--vram-slots", min=1, help="GPU: exactly this many VRAM expert slots."),
    vram_policy: str = typer.Option("freq", "--vram-policy", help="VRAM slot replacement: freq | lru | rdf | lfu."),
    stream_tile_kb: int = typer.Option(1024, "--stream-tile-kb", min=4, help="GPU: tile of the speculative copy lane in KiB (a demand waits behind at most one)."),
    max_context: int = typer.Option(4096, "--max-context", min=16, help="KV positions the VRAM budget reserves."),
    http_shown: Optional[str] = typer.Option(None, "--http-shown", hidden=True,  # set by --detach for its child
                                             help="The --http address a gateway beside this run listens on."),
    pilot: str = typer.Option("off", "--pilot", metavar="off|on|N",
                              help="Router lookahead: prefetch the experts layer l+N will likely use into the RAM tier "
                                   "while layer l computes (on = 1 layer ahead; docs/pilot.md)."),
    experts: Optional[str] = typer.Option(None, "--experts", help="When --model is a checkpoint: the routed expert "
                                          "format it is converted to once (default as `coli convert`: int4)."),
    dense: Optional[str] = typer.Option(None, "--dense", help="When --model is a checkpoint: the dense core format "
                                        "(default as `coli convert`: int8)."),
    max_batch: int = typer.Option(DEFAULT_MAX_BATCH, "--max-batch", min=1,
                                  help="Sequences the executor runs at once (continuous batching); the rest wait."),
    step_tokens: int = typer.Option(DEFAULT_STEP_TOKENS, "--step-tokens", min=1,
                                    help="A step's token budget: one per decoding sequence, the rest for prompt chunks "
                                         "(bounds inter-token latency while prompts prefill)."),
    prefill_chunk: int = typer.Option(0, "--prefill-chunk", min=0, metavar="N",
                                      help="A step's token budget while the experts stream (not all resident in VRAM): "
                                           "a step copies nearly every expert anyway, so prompts go in chunks this "
                                           "large, decode rows riding along. 0 = auto: GPU, the largest power of two "
                                           "<= 8192 and --max-context whose activations take <= 1/8 of --vram-gb "
                                           "(reserved from it); CPU, --step-tokens."),
    mtp: str = typer.Option("off", "--mtp", metavar="off|on|N|auto",
                            help="MTP speculative decoding for requests that do not say (their \"mtp\" field): "
                                 "draft with the model's MTP head, verify in one step (docs/mtp.md)."),
) -> None:
    """Start the stage processes (reader, RAM tier, executor) under a supervisor and serve the model."""
    from coli.model.mtp import mtp_mode
    try:
        mtp = mtp_mode(mtp)    # a bad --mtp is refused before anything starts
    except ColiError as e:
        fail(str(e))
    model = _container_for(model, experts, dense)
    if api_key_file is not None and not http:
        fail("--api-key-file is for the HTTP gateway: give --http too")
    gateway = _gateway_beside(name, http, startup_timeout, detach, api_key_file) if http else None
    ok = False
    try:
        gpu = {"vram_gb": vram_gb, "vram_slots": vram_slots, "policy": vram_policy, "tile_kb": stream_tile_kb,
               "max_context": max_context}
        _up(model, name, ram_gb, device, detach, startup_timeout, reader_threads, queue_depth, log_level,
            record_routing, pilot, gpu, stage_timeout, http or http_shown, batch=(max_batch, step_tokens, prefill_chunk),
            mtp=mtp)
        ok = True
        if gateway is not None and detach:
            _confirm_gateway(gateway, name, http, startup_timeout)
    finally:  # foreground: the run has stopped; detached: only if the run did not come up
        if gateway is not None and (not detach or not ok) and gateway.poll() is None:
            gateway.terminate()


# ---- --model: a registry name or a checkpoint becomes a container here, in the foreground (progress shown, also
# before --detach), so the run itself only ever opens a container ----
@clean_errors
def _container_for(model: Optional[Path], experts: Optional[str], dense: Optional[str]) -> Optional[Path]:
    from coli.model_store import resolve_container

    if model is None and experts is None and dense is None:
        return None   # the demo model: the supervisor converts it (f32, tiny)
    from coli.hub.progress import transfer_bars

    with transfer_bars(sys.stderr.isatty(), ("converting", "bytes")) as (note, bar):
        return resolve_container(model, report=note, experts=experts, dense=dense, progress=bar)


# ---- --http: the gateway (coli serve) as a process beside the run; it waits for the run and exits with it ----
def _gateway_beside(name: str, http: str, startup_timeout: float, detach: bool, api_key_file: Path | None = None):
    from coli.cli.serve import bind_socket, parse_http, read_api_key
    from coli.protocol.rundir import RunDir, default_base
    from coli.protocol.errors import RunDirError

    try:
        host, port = parse_http(http)
        if port:  # fail now, before starting a run that would come up without its gateway
            bind_socket(host, port).close()
        read_api_key(None, str(api_key_file) if api_key_file else None)  # a bad key file fails before the run starts
        live = RunDir(name, create=False).is_live()
    except RunDirError:
        live = False
    except ColiError as e:
        fail(str(e))
    if live:
        return None  # `coli up` is about to say the run is already up
    args = [sys.executable, "-m", "coli.cli.main", "serve", "--name", name, "--http", http, "--exit-with-run",
            "--wait", str(startup_timeout * 3 + 600)]
    if api_key_file is not None:
        args += ["--api-key-file", str(api_key_file.resolve())]  # the path, never the key, goes on the command line
    if not detach:
        return subprocess.Popen(args, stdin=subprocess.DEVNULL)
    base = default_base()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(base / f"{name}.serve.log", "w") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    print(f"HTTP gateway starting on {http} beside run {name!r} (pid {proc.pid}; log {base / f'{name}.serve.log'})")
    return proc


def _confirm_gateway(gateway, name: str, http: str, startup_timeout: float) -> None:
    """--http with --detach: the run is up; return once its gateway listens. A gateway that exits instead
    (the port taken meanwhile, a bad --http host) takes the run down with it and `coli up` fails."""
    from coli.serve.client import Client
    from coli.protocol.rundir import default_base

    log = default_base() / f"{name}.serve.log"
    deadline = time.monotonic() + startup_timeout + 60
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "listening on" in text:
            return
        if gateway.poll() is not None:
            break
        time.sleep(0.1)
    try:
        with Client(name) as c:
            c.down("its HTTP gateway did not start", wait=30)
    except ColiError:
        pass
    if gateway.poll() is None:
        gateway.terminate()
    tail = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1] if log.exists() else ""
    fail(f"--http {http}: the HTTP gateway did not start ({tail}); run {name!r} was stopped (log {log})", code=1)


@clean_errors
def _up(model, name, ram_gb, device, detach, startup_timeout, reader_threads, queue_depth, log_level,
        record_routing=None, pilot="off", gpu=None, stage_timeout=5.0, http=None,
        batch=(DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS, 0), mtp="off"):
    from coli.cli.common import require_device
    from coli.model_store import check_model_dir
    from coli.pilot import parse_pilot
    from coli.stages.supervisor.process import RunOptions, run_supervisor

    if log_level not in LOG_LEVELS:
        raise ColiError(f"--log-level {log_level!r} is not a level: choose from {', '.join(LOG_LEVELS)}")
    try:
        ahead = parse_pilot(pilot)
    except ValueError as e:
        raise ColiError(str(e)) from None
    if model is not None:
        model = check_model_dir(model, names=True)   # a directory, or a name `coli models` lists
    require_device(device)
    if detach:
        return _detach(model, name, ram_gb, device, startup_timeout, reader_threads, queue_depth, log_level,
                       record_routing, ahead, gpu, stage_timeout, http, batch, mtp)
    opts = RunOptions(name=name, model=str(model) if model else None, ram_gb=ram_gb, device=device,
                      startup_timeout=startup_timeout, reader_threads=reader_threads, queue_depth=queue_depth,
                      log_level=log_level, record_routing=str(record_routing.resolve()) if record_routing else None,
                      pilot=ahead, gpu=dict(gpu or {}), stage_timeout=stage_timeout, http=http,
                      max_batch=batch[0], step_tokens=batch[1], prefill_chunk=batch[2], mtp=mtp)
    say = _say_while_the_terminal_lasts
    if sys.stdin is not None and sys.stdin.isatty():
        say("press Ctrl-C (or run `coli down" + ("" if name == "default" else f" --name {name}") + "`) to stop")
    stopped = run_supervisor(opts, say)
    if stopped.failed:  # the run died (a stage crashed): a script or a unit file must see it
        raise typer.Exit(1)


def _say_while_the_terminal_lasts(message: str) -> None:
    # a closed terminal (SIGHUP) turns stderr into EIO: the run must still stop cleanly, and its log says why
    try:
        print(message, file=sys.stderr, flush=True)
    except OSError:
        pass


def _detach(model, name, ram_gb, device, startup_timeout, reader_threads, queue_depth, log_level, record_routing=None,
            pilot=0, gpu=None, stage_timeout=5.0, http=None, batch=(DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS, 0), mtp="off"):
    from coli.protocol.rundir import RunDir, default_base

    args = [sys.executable, "-m", "coli.cli.main", "up", "--name", name, "--ram-gb", str(ram_gb), "--device", device,
            "--startup-timeout", str(startup_timeout), "--reader-threads", str(reader_threads),
            "--queue-depth", str(queue_depth), "--log-level", log_level, "--stage-timeout", str(stage_timeout),
            "--max-batch", str(batch[0]), "--step-tokens", str(batch[1]), "--prefill-chunk", str(batch[2]),
            "--mtp", mtp]
    if model is not None:
        args += ["--model", str(model.resolve())]
    if record_routing is not None:
        args += ["--record-routing", str(record_routing.resolve())]
    if pilot:
        args += ["--pilot", str(pilot)]
    if http:
        args += ["--http-shown", http]  # the gateway is ours to start (done above); the run only records it
    for k, v in (gpu or {}).items():
        if v is not None:
            args += [{"policy": "--vram-policy", "tile_kb": "--stream-tile-kb"}.get(k, "--" + k.replace("_", "-")), str(v)]
    base = default_base()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    out_path = base / f"{name}.up.log"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + startup_timeout * 3 + 600  # conversion on first use may take a while
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ColiError(f"`coli up` exited with code {proc.returncode} during start-up:\n"
                            + out_path.read_text()[-2000:])
        try:
            state = RunDir(name, create=False).read_state() or {}
        except Exception:
            state = {}
        if state.get("state") == "ready" and state.get("supervisor_pid") == proc.pid:
            print(out_path.read_text().strip())
            print(f"run {name!r} is up in the background (supervisor pid {proc.pid}); "
                  f"stop it with `coli down{'' if name == 'default' else ' --name ' + name}`")
            return
        time.sleep(0.1)
    proc.terminate()
    raise ColiError(f"run {name!r} did not become ready in time; see {out_path}")


def down(name: str = typer.Option("default", "--name", help="Run name."),
         timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for the run to stop.")) -> None:
    """Stop a run: drain, stop the stages, free shared memory. Cleans up a run whose supervisor died."""
    _down(name, timeout)


@clean_errors
def _down(name, timeout):
    from coli.serve.client import Client, RunNotFound
    from coli.protocol.errors import RunDirError
    from coli.protocol.rundir import RunDir
    from coli.stages.supervisor.process import clean_stale

    from coli.stages.supervisor.sweep import describe, sweep_dead_segments

    swept = sweep_dead_segments()  # leftovers of SIGKILLed runs of any name
    if swept:
        print(describe(swept))
    try:
        rd = RunDir(name, create=False)
    except RunDirError:
        raise ColiError(f"no run named {name!r}") from None
    if not rd.is_live():
        _down_not_live(rd)
        return
    try:
        with Client(name) as c:
            c.down(wait=timeout)
    except RunNotFound:
        clean_stale(rd, print)
        return
    print(f"run {name!r} stopped")


def _down_not_live(rd) -> None:
    """A run dir whose run is not up: clean what a dead supervisor left, or say it is stopped already.
    The claim is taken first, so this never races a `coli up` of the same name."""
    from coli.serve.client import not_up_message
    from coli.protocol.rundir import RunClaimed
    from coli.stages.supervisor.process import clean_stale

    try:
        rd.claim()
    except RunClaimed:
        raise ColiError(f"run {rd.name!r} is starting (or being cleaned up by another `coli down`): "
                        f"try again in a moment") from None
    try:
        if rd.is_stale():
            clean_stale(rd, print)
        else:
            print(not_up_message(rd).replace("start it with", "nothing to stop; start it with"))
    finally:
        rd.release()


def status(name: str = typer.Option("default", "--name", help="Run name."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Each stage's pid, state and uptime, and the run's model and budgets."""
    _status(name, as_json)


@clean_errors
def _status(name, as_json):
    from coli.serve.client import Client

    with Client(name) as c:
        st = c.status()
    if as_json:
        print(json.dumps(st, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"run [bold]{st['name']}[/] — model {st['model']} — supervisor pid {st['supervisor_pid']}, "
              f"up {st['uptime_s']:.0f} s, {st['queued']} request(s) queued")
    con.print(f"RAM tier: {st['ram_slots']} slots × {st['slot_bytes'] / 2**20:.2f} MiB "
              f"({100 * st['ram_fraction_of_experts']:.0f}% of the experts, --ram-gb {st['ram_gb']}), device {st['device']}")
    t = Table("stage", "pid", "state", "uptime s", "last heartbeat")
    for n, s in st["stages"].items():
        state = s["state"]
        if state == "unresponsive":  # say why, from the supervisor's look at the process
            state = f"[bold red]unresponsive[/]: {s.get('info', {}).get('unresponsive', '')}"
        age = s.get("heartbeat_age_s")
        t.add_row(n, str(s["pid"]), state, f"{s['uptime_s']:.0f}", "-" if age is None else f"{age:.1f} s ago")
    con.print(t)


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
    app.command("status")(status)
