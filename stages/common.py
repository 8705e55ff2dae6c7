"""What every stage process does the same way: JSON-line logging through structlog (configured in the
process, after spawn), noticing that the supervisor is gone, and a tiny event loop over a type ->
handler table (SGLang style) that logs and survives malformed messages."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import structlog

PR_SET_PDEATHSIG = 1


def configure_logging(log_path: Path | str | None, stage: str, level: str = "info") -> structlog.BoundLogger:
    """structlog -> one JSON object per line in `log_path` (and nothing on stdout/stderr, which belong
    to the user's terminal). Bound: stage, pid."""
    handlers: list[logging.Handler] = []
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, encoding="utf-8"))
    else:
        handlers.append(logging.StreamHandler(sys.stderr))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        h.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(h)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(stage=stage, pid=os.getpid())
    return structlog.get_logger()


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when the parent (the supervisor) dies, so a SIGKILLed supervisor
    leaves no orphans even if a stage is stuck in a long call. Linux only; elsewhere the parent
    sentinel poll in each loop does the job."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def parent_sentinel() -> int | None:
    """A file descriptor that becomes readable when the parent process exits (spawn context)."""
    p = multiprocessing.parent_process()
    return p.sentinel if p is not None else None


def parent_alive(initial_ppid: int) -> bool:
    return os.getppid() == initial_ppid


class LogOnce:
    """Logs the first occurrence of each kind of event, counts the rest."""

    def __init__(self, log: Any):
        self.log = log
        self.counts: dict[str, int] = {}

    def __call__(self, kind: str, **fields: Any) -> None:
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        if n == 0:
            self.log.warning(kind, **fields, note="logged once; further occurrences are only counted")


class Ticker:
    """True once every `period` seconds (stats messages)."""

    def __init__(self, period: float):
        self.period = period
        self.next = time.monotonic() + period

    def due(self) -> bool:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.period
            return True
        return False

    def timeout_ms(self) -> int:
        return max(0, int((self.next - time.monotonic()) * 1000))


Handler = Callable[[Any], None]


def orphan_cleanup(*arena_names: str) -> None:
    """The supervisor died without cleaning up (SIGKILL): the run's shared memory must not outlive it.
    Unlinking is idempotent, so every stage does it; mappings stay valid until each process exits."""
    from coli.protocol.arena import Arena
    for name in arena_names:
        try:
            Arena.unlink_name(name)
        except Exception:
            pass


def drain_router(sock, log):
    """Every message waiting on a ROUTER socket, as (peer, message). A malformed one is logged as
    `protocol_error` and skipped: one bad peer never takes a stage down."""
    import zmq

    from coli.protocol.errors import ProtocolError
    from coli.protocol.sockets import recv_from

    while True:
        try:
            yield recv_from(sock, flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        except ProtocolError as e:
            log.error("protocol_error", error=str(e), peer=repr(e.peer))


def greet(sock, peer: bytes, hello, stage: str, info: dict, log, control: bytes | None = None) -> bool:
    """Answer a Hello on a stage's socket. A wrong protocol version is logged as `protocol_error`; the
    supervisor's Hello is answered with Hello + Ready (the handshake). True if it was the supervisor.
    `control` is the supervisor's routing identity (a per-run secret): a Hello that claims to be the
    supervisor from any other peer is refused, so no other process can take the supervisor's role."""
    from coli.protocol.errors import ProtocolError
    from coli.protocol.handshake import check_hello, make_hello
    from coli.protocol.messages import Ready
    from coli.protocol.sockets import send

    try:
        check_hello(hello)
    except ProtocolError as e:
        log.error("protocol_error", error=str(e), peer=repr(peer))
        return False
    if hello.stage != "supervisor":
        return False
    if control is not None and peer != control:
        log.error("protocol_error", peer=repr(peer),
                  error="Hello as the supervisor refused: this peer is not the run's supervisor")
        return False
    send(sock, make_hello(stage), peer=peer)
    send(sock, Ready(stage, info), peer=peer)
    return True


def send_stats(sock, supervisor: bytes, stage: str, counters: dict) -> None:
    """Periodic counters to the supervisor; dropped (never blocking the stage) if its queue is full."""
    import time

    import zmq

    from coli.protocol.messages import Stats
    from coli.protocol.sockets import send

    try:
        send(sock, Stats(stage, time.time(), counters), peer=supervisor, flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


HEARTBEAT_PERIOD_S = 0.25


class HeartbeatThread:
    """Sends `Heartbeat` to the supervisor every `period` seconds from a thread with its own socket (a
    ZeroMQ socket belongs to one thread), so the stage's hot path neither sends nor blocks it. It proves
    the process is alive and scheduled, not that the stage's loop progresses: a long prefill still beats.
    Sends never block: with the supervisor gone or slow, beats are dropped."""

    def __init__(self, endpoint: str, stage: str, period: float = HEARTBEAT_PERIOD_S):
        import threading

        self.endpoint, self.stage, self.period = endpoint, stage, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{stage}", daemon=True)

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def _run(self) -> None:
        import zmq

        from coli.protocol.messages import Heartbeat
        from coli.protocol.sockets import send

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while not connected: stale beats mean nothing
        try:
            sock.connect(self.endpoint)
            pid = os.getpid()
            while not self._stop.is_set():
                try:
                    send(sock, Heartbeat(self.stage, pid, time.time()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self._stop.wait(self.period)
        finally:
            sock.close(linger=0)
            ctx.term()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
