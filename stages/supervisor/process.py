"""The supervisor (`coli up`): creates the arena, spawns the stages, runs the HELLO -> READY handshake
with a deadline while watching every child's sentinel, brokers clients to the executor, republishes
stats, and owns the one shutdown path (coli down, Ctrl-C, SIGTERM, a stage dying): tell clients,
ask stages to stop, join with a deadline, kill, unlink shared memory, remove the run directory.

Sockets (in the run dir): binds `client` (ROUTER, clients) and `stats` (PUB); connects one DEALER
(identity "supervisor") to each stage's own socket."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from coli import __version__
from coli.errors import ColiError
from coli.protocol.arena import Arena
from coli.protocol.errors import ProtocolError
from coli.protocol.handshake import check_hello, make_hello
from coli.protocol.messages import (ERROR_BAD_REQUEST, ERROR_PROTOCOL, ERROR_STAGE_UNRESPONSIVE, Cancel, Done,
                                    DropSession, Error, GenerateRequest, Heartbeat, Hello, Ready, Shutdown, StageDead,
                                    Stats, StatusReply, StatusRequest, Token)
from coli.protocol.rundir import RunClaimed, RunDir
from coli.protocol.sockets import make_socket, recv, recv_from, send
from coli.stages.common import configure_logging
from coli.stages.executor.batch_defaults import DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS
from coli.stages.ramtier.core import ResidencyTable
from coli.stages.supervisor.admission import Limits, refusal
from coli.stages.supervisor.core import Pending, RequestBook
from coli.stages.supervisor.sweep import describe, segment_name, sweep_dead_segments

STAGES = ("reader", "ramtier", "executor")
# what stops a run cleanly: SIGHUP is the terminal of a foreground `coli up` closing
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
CLIENT_TOO_SLOW = "client_too_slow"  # the error code a client gets when it stopped reading its tokens


class StartupError(ColiError):
    pass


@dataclass
class RunOptions:
    name: str = "default"
    model: str | None = None
    ram_gb: float = 4.0
    device: str = "auto"
    startup_timeout: float = 120.0
    stop_timeout: float = 5.0
    reader_threads: int = 4
    queue_depth: int = 16
    pin_fraction: float = 0.25
    log_level: str = "info"
    run_base: str | None = None
    record_routing: str | None = None
    pilot: int = 0  # router lookahead: prefetch layer l+pilot's predicted experts (0 = off)
    gpu: dict = field(default_factory=dict)  # coli.loader.GpuOptions fields: vram_gb, vram_slots, policy, ...
    stage_timeout: float = 5.0  # a ready stage silent (no heartbeat) this long is unresponsive
    http: str | None = None  # the --http address of the gateway `coli up` started beside the run (for coli ps)
    max_batch: int = DEFAULT_MAX_BATCH  # sequences the executor runs at once (continuous batching)
    step_tokens: int = DEFAULT_STEP_TOKENS  # one step's token budget: every decode row plus prefill chunks
    mtp: str = "off"        # MTP drafting for a request that does not say: off | on | 1..3 | auto (docs/mtp.md)
    prefill_chunk: int = 0  # a step's token budget while the experts stream (0: auto from the VRAM budget)


@dataclass
class StageProc:
    name: str
    proc: Any
    sock: zmq.Socket
    state: str = "starting"
    t_start: float = field(default_factory=time.time)
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    hello: bool = False
    last_beat: float = 0.0  # time.monotonic() of its last Heartbeat (or of becoming ready)


def clean_stale(rd: RunDir, say: Callable[[str], None]) -> None:
    """A run dir whose supervisor is gone: kill what remains of its stages, unlink its shared memory,
    remove the directory (logs kept), and say so."""
    state = rd.read_state() or {}
    rec = rd.read_pid()
    killed = 0
    for st in (state.get("stages") or {}).values():
        pid, start = st.get("pid"), st.get("start")
        if pid and _same_process_alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    removed = [n for n in state.get("arenas", []) if Arena.unlink_name(n)]
    rd.cleanup(keep_logs=True)
    rd.write_state(stopped_state(state, f"its supervisor (pid {rec[0] if rec else '?'}) died; cleaned up", True))
    say(f"cleaned up stale run {rd.name!r} (supervisor pid {rec[0] if rec else '?'} is gone): "
        f"{len(removed)} shared-memory segment(s) removed, {killed} leftover stage process(es) killed")


def stopped_state(state: dict, reason: str, failed: bool) -> dict:
    """What a run dir keeps after its run stopped (beside its logs): when, why, and what it served, so
    `coli status`, `coli down` and `coli ps` can say "stopped" instead of guessing from a missing pid."""
    keep = ("name", "model", "container", "device", "started", "supervisor_pid", "http")
    return {**{k: state[k] for k in keep if k in state}, "state": "stopped", "stopped": time.time(),
            "reason": reason, "failed": failed}


def sessions_dir(container: Path) -> Path:
    """Saved sessions live beside the container cache, per container (a container dir may be read-only)."""
    from coli.model_store import cache_root
    return cache_root().parent / "sessions" / Path(container).resolve().name


def _same_process_alive(pid: int, start: int | None) -> bool:
    from coli.protocol.rundir import _alive
    return _alive(pid, start)


def _proc_start(pid: int) -> int | None:
    from coli.protocol.rundir import _process_start
    return _process_start(pid)


class Supervisor:
    def __init__(self, opts: RunOptions, say: Callable[[str], None] = print):
        self.opts = opts
        self.say = say
        self.rd: RunDir | None = None
        self.arenas: list[Arena] = []
        self.stages: dict[str, StageProc] = {}
        self.book = RequestBook(max_batch=opts.max_batch)
        self.stop_reason: str | None = None
        self.failed = False  # the run stopped because something died, not because it was asked to
        self.t_start = time.time()
        self.stats_out: dict[str, dict] = {}
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "clients": 0,
                         "protocol_errors": 0, "last_latency_s": 0.0, "queued": 0, "running": 0}
        self.clients: set[bytes] = set()
        self.owed: dict[bytes, dict[str, Error]] = {}  # slow readers: client -> request id -> its error, once it reads

    # ---- start -----------------------------------------------------------------------------------
    def start(self) -> None:
        o = self.opts
        rd = RunDir(o.name, o.run_base, create=True)
        try:
            rd.claim()  # atomic: of two `coli up` of one name at the same instant, exactly one gets here
        except RunClaimed as e:
            raise StartupError(str(e)) from None
        try:
            if rd.is_live():  # a holder of the claim would have kept it: a run of an older install
                pid = rd.read_pid()[0]
                raise StartupError(f"run {o.name!r} is already up (supervisor pid {pid}); stop it with "
                                   f"`coli down --name {o.name}` or pick another --name")
            if rd.is_stale():
                clean_stale(rd, self.say)
            rd.write_pid()
            swept = sweep_dead_segments()  # other names' leftovers too (a SIGKILLed process group)
            if swept:
                self.say(describe(swept))
        except BaseException:
            rd.release()
            raise
        self.rd = rd
        self.log = configure_logging(rd.log_path("supervisor"), "supervisor", o.log_level)
        # every run of a name appends to the same logs: this record starts the run's part (`coli logs` draws
        # it as a dated separator)
        self.log.info("run_started", run=o.name, supervisor_pid=os.getpid(), model=str(o.model or "demo"),
                      date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.t_start)))
        try:
            self._start_stages()
        except BaseException as e:
            # `coli logs` must hold the cause too, not only the terminal of `coli up` (or its --detach log)
            self.log.error("startup_failed", error=f"{type(e).__name__}: {e}" if not isinstance(e, ColiError) else str(e))
            self.shutdown("start-up failed")
            raise

    def _start_stages(self) -> None:
        from coli.container.reader import ContainerReader
        from coli.model_store import resolve_container

        o, rd = self.opts, self.rd
        if o.device not in ("auto", "cpu", "gpu"):
            raise StartupError(f"--device {o.device!r} is not known (use auto, cpu or gpu)")
        device = o.device          # the executor resolves auto (a GPU when PyCUDA and a device are there)
        container = resolve_container(o.model, report=self.say)
        view = ContainerReader(container, cache_dense=False)
        cfg, slot_bytes = view.config, view.record_layout.nbytes
        view.close()
        n_total = len(cfg.moe_layers) * cfg.n_routed_experts
        if o.ram_gb <= 0:
            raise StartupError(f"--ram-gb must be > 0 (got {o.ram_gb})")
        n_slots = max(1, min(n_total, int(o.ram_gb * 1e9 // slot_bytes)))
        n_keys = cfg.num_hidden_layers * cfg.n_routed_experts
        arena = Arena.create(segment_name(o.name, os.getpid(), "experts"), slot_bytes, n_slots)
        self.arenas.append(arena)
        table = Arena.create(segment_name(o.name, os.getpid(), "residency"), ResidencyTable.nbytes(n_keys, n_slots), 1)
        self.arenas.append(table)
        self.model_info = {"model": str(o.model or "demo"), "container": str(container), "layers": cfg.num_hidden_layers,
                           "experts_per_layer": cfg.n_routed_experts, "moe_layers": len(cfg.moe_layers),
                           "ram_gb": o.ram_gb, "ram_slots": n_slots, "slot_bytes": slot_bytes,
                           "ram_fraction_of_experts": round(n_slots / n_total, 4), "device": device,
                           "eos_token_ids": list(cfg.eos_token_ids), "vocab_size": cfg.vocab_size,
                           "max_position_embeddings": cfg.max_position_embeddings,
                           "stage_timeout_s": o.stage_timeout,
                           "version": __version__}
        self.limits = Limits.from_model_info(self.model_info)
        self.say(f"run {o.name!r}: model {self.model_info['model']} ({cfg.num_hidden_layers} layers, "
                 f"{len(cfg.moe_layers)}x{cfg.n_routed_experts} experts), RAM tier {n_slots} slots x "
                 f"{slot_bytes / 2**20:.2f} MiB ({100 * n_slots / n_total:.0f}% of the experts), device {device}")
        self.log.info("starting", **self.model_info)
        self._write_state("starting")

        from coli.stages.executor.process import executor_main
        from coli.stages.ramtier.process import ramtier_main
        from coli.stages.reader.process import reader_main

        base = str(rd.base)
        # Our routing identity on the stages' sockets, secret to this run (it reaches the stages through the
        # spawn pipe, not argv): a stage takes Hello/Shutdown/requests as the supervisor's from it alone.
        control = f"supervisor-{secrets.token_hex(16)}".encode()
        targets = {
            "reader": (reader_main, (o.name, base, arena.name, str(container), o.reader_threads, o.queue_depth,
                                     o.log_level, table.name, control)),
            "ramtier": (ramtier_main, (o.name, base, arena.name, table.name, str(container), o.pin_fraction,
                                       o.queue_depth, o.log_level, control)),
            "executor": (executor_main, (o.name, base, arena.name, table.name, str(container), device, o.log_level,
                                         str(sessions_dir(container)), o.record_routing, o.pilot, dict(o.gpu),
                                         control, o.max_batch, o.step_tokens, o.mtp, o.prefill_chunk)),
        }
        self.ctx = zmq.Context()
        self.client_sock = make_socket(self.ctx, zmq.ROUTER, rd.endpoint("client"), bind=True)
        self.pub = make_socket(self.ctx, zmq.PUB, rd.endpoint("stats"), bind=True, hwm=64)
        # bound before any stage starts, so a stage's first beat has somewhere to go
        self.beats = make_socket(self.ctx, zmq.PULL, rd.endpoint("heartbeat"), bind=True, hwm=256)
        mp = multiprocessing.get_context("spawn")
        for name in STAGES:
            fn, args = targets[name]
            p = mp.Process(target=_stage_entry, args=(fn, args, [arena.name, table.name], name, rd.endpoint("heartbeat"),
                                                       str(rd.log_path(name))),
                           name=f"coli-{o.name}-{name}",
                           daemon=False)
            p.start()
            sock = make_socket(self.ctx, zmq.DEALER, rd.endpoint(name), bind=False, identity=control)
            send(sock, make_hello("supervisor"))
            self.stages[name] = StageProc(name, p, sock)
        self._write_state("starting")
        self._handshake()
        ex = self.stages["executor"].info
        if ex.get("device"):
            self.model_info["device"] = ex["device"]
        if ex.get("vram"):
            self.model_info["vram"] = ex["vram"]
            self.say(f"executor on {ex.get('gpu_name', 'the GPU')}: {ex['vram']}")
        self._write_state("ready")
        self.say(f"run {o.name!r} is up: {', '.join(f'{s.name} pid {s.proc.pid}' for s in self.stages.values())}")
        self.log.info("ready", **{f"{n}_pid": s.proc.pid for n, s in self.stages.items()})

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout
        poller = zmq.Poller()
        for s in self.stages.values():
            poller.register(s.sock, zmq.POLLIN)
            poller.register(s.proc.sentinel, zmq.POLLIN)
        while any(s.state != "ready" for s in self.stages.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                late = [s.name for s in self.stages.values() if s.state != "ready"]
                raise StartupError(f"stage {late[0]!r} did not become ready in {self.opts.startup_timeout:.0f} s "
                                   f"(raise --startup-timeout; see `coli logs --name {self.opts.name} --stage {late[0]}`)")
            events = dict(poller.poll(int(min(left, 0.2) * 1000)))
            for s in self.stages.values():
                if s.proc.sentinel in events or not s.proc.is_alive():
                    s.proc.join(0.1)
                    cause = _last_error(self.rd.log_path(s.name))
                    raise StartupError(f"stage {s.name!r} exited with code {s.proc.exitcode} during start-up"
                                       f"{': ' + cause if cause else ''} "
                                       f"(see `coli logs --name {self.opts.name} --stage {s.name}`)")
                if s.sock in events:
                    while s.sock.poll(0):
                        try:
                            msg = recv(s.sock)
                        except ProtocolError as e:
                            raise StartupError(f"stage {s.name!r} sent a bad message during start-up: {e}") from None
                        if isinstance(msg, Hello):
                            check_hello(msg, stage=s.name)
                            s.hello = True
                        elif isinstance(msg, Ready) and s.hello:
                            s.state, s.info = "ready", dict(msg.info)
                            s.t_start = time.time()
                            s.last_beat = time.monotonic()
                        elif isinstance(msg, Stats):
                            s.stats = dict(msg.counters)

    def _write_state(self, state: str) -> None:
        self.rd.write_state(self._state_dict(state))

    def _state_dict(self, state: str) -> dict:
        return {
            "state": state, "name": self.opts.name, "supervisor_pid": os.getpid(), "started": self.t_start,
            "http": self.opts.http,
            "arenas": [a.name for a in self.arenas], **getattr(self, "model_info", {}),
            "stages": {n: {"pid": s.proc.pid, "start": _proc_start(s.proc.pid) if s.proc.pid else None,
                           "state": s.state} for n, s in self.stages.items()},
        }

    # ---- serve -------------------------------------------------------------------------------------
    def serve(self) -> str:
        """Run until shutdown; returns the reason."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        old_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        got: list[int] = []
        handlers = {sig: signal.signal(sig, lambda s, f: got.append(s)) for sig in STOP_SIGNALS}
        poller = zmq.Poller()
        poller.register(self.client_sock, zmq.POLLIN)
        poller.register(self.beats, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        for s in self.stages.values():
            poller.register(s.sock, zmq.POLLIN)
            poller.register(s.proc.sentinel, zmq.POLLIN)
        next_stats = time.monotonic() + 0.5
        try:
            while self.stop_reason is None:
                events = dict(poller.poll(200))
                if got:
                    self.stop_reason = f"signal {signal.Signals(got[0]).name}"
                    break
                if wake_r in events:
                    try:
                        os.read(wake_r, 512)
                    except BlockingIOError:
                        pass
                for s in self.stages.values():
                    if s.proc.sentinel in events or not s.proc.is_alive():
                        self._stage_died(s)
                        break
                if self.stop_reason:
                    break
                for s in self.stages.values():
                    if s.sock in events:
                        self._from_stage(s)
                if self.beats in events:
                    self._heartbeats()
                self._check_heartbeats()
                if self.client_sock in events:
                    self._from_clients()
                self._dispatch()
                if self.owed:
                    self._flush_owed()
                if time.monotonic() >= next_stats:
                    next_stats = time.monotonic() + 0.5
                    self._publish_own_stats()
        finally:
            signal.set_wakeup_fd(old_fd)
            for sig, h in handlers.items():
                signal.signal(sig, h)
            os.close(wake_r)
            os.close(wake_w)
        return self.stop_reason or "stopped"

    def _stage_died(self, s: StageProc) -> None:
        s.proc.join(0.05)
        code = s.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        s.state = "dead"
        reason = f"stage {s.name!r} (pid {s.proc.pid}) {how}"
        self.log.error("stage_died", stage=s.name, pid=s.proc.pid, exitcode=code)
        self.say(f"{reason}; shutting the run down")
        for p in self.book.clear():
            self._to_client(p.client, StageDead(s.name, reason, code))
        self.stop_reason = reason
        self.failed = True

    # ---- liveness: heartbeats --------------------------------------------------------------------
    def _pending(self, sock, peer: str):
        """The messages waiting on `sock`, decoded, until it has none; a bad one is counted and logged, not
        fatal (a stage's socket and the heartbeat socket share this)."""
        while True:
            try:
                yield recv(sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError as e:
                self.counters["protocol_errors"] += 1
                self.log.error("protocol_error", error=str(e), peer=peer)

    def _heartbeats(self) -> None:
        for msg in self._pending(self.beats, "heartbeat"):
            s = self.stages.get(msg.stage) if isinstance(msg, Heartbeat) else None
            if s is None or msg.pid != s.proc.pid:
                continue  # not one of our stages (a stage's pid is the one we spawned)
            s.last_beat = time.monotonic()
            if s.state == "unresponsive":
                s.state = "ready"
                self.log.warning("stage_responsive", stage=s.name, pid=s.proc.pid)
                self.say(f"stage {s.name!r} (pid {s.proc.pid}) is responsive again; the run takes requests")

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for s in self.stages.values():
            if s.state == "ready" and now - s.last_beat > self.opts.stage_timeout:
                self._stage_unresponsive(s, now - s.last_beat)

    def _stage_unresponsive(self, s: StageProc, silent_s: float) -> None:
        """Every request waiting fails now, naming the stage; the run stays up (a stopped stage may be
        continued: SIGCONT, a debugger letting go), refuses new requests with the same error while the
        stage is silent and takes them again at its next heartbeat."""
        s.state = "unresponsive"
        cond = _process_condition(s.proc.pid)
        s.info = {**s.info, "unresponsive": cond}
        reason = (f"stage {s.name!r} (pid {s.proc.pid}) is unresponsive: no heartbeat for {silent_s:.1f} s ({cond}); "
                  f"requests fail until it answers again (limit: --stage-timeout {self.opts.stage_timeout:g})")
        self.log.error("stage_unresponsive", stage=s.name, pid=s.proc.pid, silent_s=round(silent_s, 2), condition=cond)
        self.say(reason)
        running = set(self.book.running)
        for p in self.book.clear():
            if p.request_id in running:
                self._cancel_running(p, f"stage {s.name!r} is unresponsive")
            self.counters["failed"] += 1
            self._to_client(p.client, Error(ERROR_STAGE_UNRESPONSIVE, reason, p.request_id))

    def _unresponsive_reason(self) -> str | None:
        for s in self.stages.values():
            if s.state == "unresponsive":
                return (f"stage {s.name!r} (pid {s.proc.pid}) is unresponsive ({s.info.get('unresponsive', '?')}): "
                        f"no heartbeat for {time.monotonic() - s.last_beat:.1f} s (limit: --stage-timeout "
                        f"{self.opts.stage_timeout:g})")
        return None

    def _from_stage(self, s: StageProc) -> None:
        for msg in self._pending(s.sock, s.name):
            if isinstance(msg, Stats):
                s.stats = dict(msg.counters)
                self.stats_out[s.name] = {"t": msg.t, **s.stats}
                try:
                    send(self.pub, msg, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            elif isinstance(msg, (Token, Done, Error)) and s.name == "executor":
                self._from_executor(msg)

    def _from_executor(self, msg) -> None:
        rid = msg.request_id
        p = self.book.by_id.get(rid) if rid is not None else None
        if p is None:
            return
        if isinstance(msg, Token):
            p.tokens += 1
            if not self._to_client(p.client, msg):
                self._cancel_running(p, "client went away")
            return
        self.book.finish(rid)
        if isinstance(msg, Done):
            self.counters["completed" if msg.finish_reason != "cancelled" else "cancelled"] += 1
            self.counters["last_latency_s"] = round(time.time() - p.t_submit, 4)
            self.log.info("request_done", request_id=rid, tokens=msg.tokens, finish=msg.finish_reason,
                          latency_s=self.counters["last_latency_s"])
        else:
            self.counters["failed"] += 1
        self._to_client(p.client, msg)

    def _cancel_running(self, p: Pending, why: str) -> None:
        self.log.info("cancel", request_id=p.request_id, reason=why)
        try:
            send(self.stages["executor"].sock, Cancel(p.request_id), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _to_client(self, client: bytes, msg) -> bool:
        owed = self.owed.get(client)
        if owed and getattr(msg, "request_id", None) in owed:
            return False  # a request stopped for a slow reader: its error takes the place of the rest
        try:
            send(self.client_sock, msg, peer=client, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # its queue is full: it stopped reading (a paused terminal, a stalled pipe)
            if isinstance(msg, Token) and client in self.clients:
                # not a silent drop: the request stops (the caller cancels it) and the client is told why
                # right after the tokens it already has (_flush_owed); its connection and queue stay
                self.log.info("client_too_slow", request_id=msg.request_id, client=repr(client))
                self.owed.setdefault(client, {})[msg.request_id] = Error(
                    CLIENT_TOO_SLOW, f"request {msg.request_id} was stopped: this client stopped reading its tokens "
                                     f"and {msg.index} were waiting for it; read them as they come", msg.request_id)
                return False
            if client in self.clients:
                self.clients.discard(client)
                self.book.drop_client(client)
            return False
        except zmq.ZMQError:  # EHOSTUNREACH: the client is gone
            if client in self.clients:
                self.clients.discard(client)
                self.book.drop_client(client)
            return False

    def _flush_owed(self) -> None:
        """Each slow reader's error, sent as soon as its queue has room again."""
        for client, errs in list(self.owed.items()):
            for rid, err in list(errs.items()):
                try:
                    send(self.client_sock, err, peer=client, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:  # gone meanwhile
                    errs.clear()
                    break
                del errs[rid]
            if not errs:
                del self.owed[client]

    def _from_clients(self) -> None:
        while True:
            try:
                peer, msg = recv_from(self.client_sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError as e:
                self.counters["protocol_errors"] += 1
                self.log.error("protocol_error", error=str(e), peer=repr(e.peer))
                if e.peer is not None:
                    self._to_client(e.peer, Error(ERROR_PROTOCOL, str(e)))
                continue
            self._client_message(peer, msg)

    def _client_message(self, peer: bytes, msg) -> None:
        if isinstance(msg, Hello):
            try:
                check_hello(msg)
            except ProtocolError as e:
                self.counters["protocol_errors"] += 1
                self.log.error("protocol_error", error=str(e), peer=repr(peer))
                self._to_client(peer, Error(ERROR_PROTOCOL, str(e)))
                return
            self.clients.add(peer)
            self.counters["clients"] += 1
            self._to_client(peer, Ready("supervisor", self.model_info))
        elif isinstance(msg, GenerateRequest):
            if msg.request_id in self.book.by_id:
                self._to_client(peer, Error(ERROR_BAD_REQUEST, f"request id {msg.request_id!r} is in use",
                                            msg.request_id))
                return
            why = refusal(msg, self.limits)
            if why:     # refused at the edge: the executor never sizes anything from it
                self.counters["refused"] = self.counters.get("refused", 0) + 1
                self.log.info("request_refused", request_id=msg.request_id, reason=why)
                self._to_client(peer, Error(ERROR_BAD_REQUEST, why, msg.request_id))
                return
            self.clients.add(peer)
            self.counters["requests"] += 1
            self.book.submit(Pending(peer, msg.request_id, msg, time.time()))
        elif isinstance(msg, Cancel):
            p, running = self.book.cancel(msg.request_id)
            if p is None or p.client != peer:
                return
            if running:
                self._cancel_running(p, "client cancelled")
            else:
                self.counters["cancelled"] += 1
                self._to_client(peer, Done(msg.request_id, "cancelled", 0, {}))
        elif isinstance(msg, DropSession):   # the executor owns the sessions (one in use goes when it ends)
            try:
                send(self.stages["executor"].sock, msg, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        elif isinstance(msg, StatusRequest):
            self._to_client(peer, StatusReply(msg.request_id, self.status()))
        elif isinstance(msg, Shutdown):
            self.log.info("down_requested", reason=msg.reason)
            self.stop_reason = f"coli down ({msg.reason})" if msg.reason else "coli down"
        else:
            self.counters["protocol_errors"] += 1
            self.log.error("protocol_error", error=f"unexpected {type(msg).__name__} from a client", peer=repr(peer))

    def _dispatch(self) -> None:
        stuck = self._unresponsive_reason()
        while stuck is not None and (p := self.book.next()) is not None:
            self.book.finish(p.request_id)
            self.counters["failed"] += 1
            self._to_client(p.client, Error(ERROR_STAGE_UNRESPONSIVE, stuck, p.request_id))
        if stuck is not None:
            return
        while (p := self.book.next()) is not None:     # up to --max-batch join the executor's batch
            p.t_start = time.time()
            try:
                send(self.stages["executor"].sock, p.message, flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                self.book.finish(p.request_id)
                self._to_client(p.client, Error("internal", f"executor unreachable: {e}", p.request_id))

    def _publish_own_stats(self) -> None:
        self.counters["queued"] = self.book.waiting  # waiting here, not the ones the executor is on
        self.counters["running"] = len(self.book.running)
        c = dict(self.counters, uptime_s=time.time() - self.t_start)
        self.stats_out["supervisor"] = {"t": time.time(), **c}
        try:
            send(self.pub, Stats("supervisor", time.time(), c), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def status(self) -> dict:
        now = time.time()
        return {
            **self.model_info, "name": self.opts.name, "supervisor_pid": os.getpid(),
            "uptime_s": round(now - self.t_start, 3), "queued": self.book.waiting,
            "running": len(self.book.running), "max_batch": self.opts.max_batch,
            "stages": {n: {"pid": s.proc.pid, "state": s.state, "uptime_s": round(now - s.t_start, 3),
                           "heartbeat_age_s": round(time.monotonic() - s.last_beat, 3) if s.last_beat else None,
                           "info": s.info} for n, s in self.stages.items()},
            "stats": self.stats_out,
        }

    # ---- stop --------------------------------------------------------------------------------------
    def shutdown(self, reason: str) -> None:
        """The one shutdown path: clients told, stages asked to stop, joined with a deadline, killed,
        shared memory unlinked, run dir removed (logs kept)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:  # a second Ctrl-C / SIGTERM / SIGHUP must not cut the cleanup short
                signal.signal(sig, signal.SIG_IGN)
        log = getattr(self, "log", None)
        if log:
            log.info("shutting_down", reason=reason)
        for p in self.book.clear():
            self._to_client(p.client, Error("shutdown", f"the run is shutting down: {reason}", p.request_id))
        for s in self.stages.values():
            if s.proc.is_alive():
                try:
                    send(s.sock, Shutdown(reason), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + self.opts.stop_timeout
        for s in self.stages.values():
            s.proc.join(max(0.0, deadline - time.monotonic()))
        for s in self.stages.values():
            if s.proc.is_alive():
                if log:
                    log.warning("stage_killed", stage=s.name, note=f"did not stop within {self.opts.stop_timeout} s")
                s.proc.kill()
                s.proc.join(2.0)
        for s in self.stages.values():
            s.sock.close(linger=0)
        for sock in (getattr(self, "client_sock", None), getattr(self, "pub", None), getattr(self, "beats", None)):
            if sock is not None:
                sock.close(linger=0)
        if hasattr(self, "ctx"):
            self.ctx.term()
        for a in self.arenas:
            try:
                a.close()
            except Exception:
                pass
            try:
                a.unlink()
            except Exception:
                Arena.unlink_name(a.name)
        self.arenas.clear()
        if self.rd is not None:
            try:
                self.rd.cleanup(keep_logs=True)
                self.rd.write_state(stopped_state(self._state_dict("stopping"), reason, self.failed))
            except Exception as e:  # never let cleanup mask the reason we are stopping
                if log:
                    log.error("cleanup_failed", error=str(e))
            self.rd.release()
        if log:
            log.info("stopped", reason=reason)


def _process_condition(pid: int) -> str:
    """Why a process may be silent, from its /proc state letter."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        letter = raw[raw.rindex(b")") + 2 :].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return "process state unknown"
    return {"T": "the process is stopped: SIGSTOP or Ctrl-Z; SIGCONT resumes it",
            "t": "the process is stopped by a debugger",
            "D": "the process is in uninterruptible IO (disk or driver)",
            "Z": "the process has exited"}.get(letter, f"process state {letter}: running but not answering")


def _last_error(log_path: Path) -> str | None:
    """The `error` field of the last error record in a stage's log (its cause of death), if any."""
    import json

    try:
        lines = log_path.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") == "error" and rec.get("error"):
            return str(rec["error"])[:300]
    return None


def _log_failure(log_path: str | None, stage: str, exc: BaseException) -> None:
    """The cause of a stage's death, as one JSON line in its own log: `coli up` points the user to `coli logs
    --stage <stage>`, and a failure before (or outside) the stage's logging would otherwise leave it empty,
    the traceback only on the terminal of `coli up`."""
    import datetime
    import json
    import traceback

    if log_path is None:
        return
    rec = {"ts": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z"), "level": "error",
           "stage": stage, "pid": os.getpid(), "event": "stage_failed", "error": f"{type(exc).__name__}: {exc}",
           "traceback": "".join(traceback.format_exception(exc))[-8000:]}
    try:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError:
        pass


def _stage_entry(fn, args, arena_names, stage, heartbeat_endpoint=None, log_path=None) -> None:
    """Runs in the spawned child: a clean signal state, then the stage's main. If the supervisor died
    (SIGKILL: the kernel sends us SIGTERM through PR_SET_PDEATHSIG, or our loop sees its sentinel), the
    run's shared memory is unlinked on the way out so nothing of the run outlives it. The unlink is done
    first thing in the SIGTERM handler too, so it cannot be skipped by where the exit lands."""
    from coli.stages.common import orphan_cleanup

    ppid = os.getppid()

    def on_term(signum, frame):
        # The supervisor stops stages with Shutdown messages (then SIGKILL), never SIGTERM: a SIGTERM is
        # the kernel telling us the supervisor died (PR_SET_PDEATHSIG; some kernels, gVisor among them,
        # deliver it before getppid() changes) or an operator killing this stage, which ends the run
        # anyway. Either way the run's shared memory goes (unlinking twice is harmless).
        orphan_cleanup(*arena_names)
        raise SystemExit(0)

    # Ctrl-C and a closing terminal (SIGHUP) reach the whole foreground process group: the supervisor
    # handles them and stops us in order; dying here at once would leave it nothing to stop cleanly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)
    from coli.stages.common import HeartbeatThread

    beat = HeartbeatThread(heartbeat_endpoint, stage).start() if heartbeat_endpoint else None
    try:
        from coli.stages.faults import Faults
        if Faults.from_env().hit(f"start_crash_{stage}"):
            raise SystemExit(f"injected start-up crash of stage {stage!r} (COLI_INJECT)")
        fn(*args)
    except SystemExit as e:
        if e.code not in (0, None):
            _log_failure(log_path, stage, e)
        raise
    except BaseException as e:
        _log_failure(log_path, stage, e)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if beat is not None:
            beat.stop()
        if os.getppid() != ppid:
            orphan_cleanup(*arena_names)


class StopSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP during start-up: unwinds through start()'s one shutdown path like Ctrl-C."""


def _stop_during_startup(signum, frame):
    raise StopSignal(f"signal {signal.Signals(signum).name} during start-up")


@dataclass(frozen=True)
class Stopped:
    reason: str
    failed: bool  # a stage died: `coli up` exits non-zero


def run_supervisor(opts: RunOptions, say: Callable[[str], None] = print) -> Stopped:
    sup = Supervisor(opts, say)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # serve() installs its own; the default would leak the arena
        signal.signal(sig, _stop_during_startup)
    sup.start()
    reason = "stopped"
    try:
        reason = sup.serve()
    finally:
        sup.shutdown(reason)
        say(f"run {opts.name!r} stopped: {reason}")
    return Stopped(reason, sup.failed)
