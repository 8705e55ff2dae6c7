"""The client side of a run: connect to the supervisor's client socket, HELLO -> READY, then generate
(streaming tokens), ask for status, or ask the run to stop. Used by `coli chat`, `coli status`,
`coli down`, `coli stats` and the HTTP gateway."""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import zmq

from coli.errors import ColiError
from coli.protocol.errors import ProtocolError, RunDirError
from coli.protocol.handshake import make_hello
from coli.protocol.messages import (ERROR_STAGE_UNRESPONSIVE, Cancel, Done, DropSession, Error, GenerateRequest,
                                    Ready, Shutdown, StageDead, StatusReply, StatusRequest, Token)
from coli.protocol.rundir import RunDir
from coli.protocol.sockets import make_socket, recv, send


class RunNotFound(ColiError):
    pass


class StageDeadError(ColiError):
    """A stage of the run died while this request was waiting; `stage` names it."""

    def __init__(self, stage: str, reason: str):
        super().__init__(f"stage {stage!r} died: {reason}")
        self.stage = stage


class RequestError(ColiError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class StageUnresponsiveError(RequestError):
    """A stage of the run stopped sending heartbeats (stopped, wedged) while this request waited; `stage`
    names it. The run stays up and takes requests again once the stage answers."""

    def __init__(self, code: str, message: str):
        super().__init__(code, message)
        m = re.match(r"stage '([^']+)'", message)
        self.stage = m.group(1) if m else None


class RunGone(ColiError):
    """The run stopped (or its supervisor died) while a request was waiting."""


class RunUnresponsive(ColiError):
    """The run's supervisor is stopped (SIGSTOP, Ctrl-Z, a debugger): nothing can answer until it resumes."""


def request_error(code: str, message: str) -> RequestError:
    """The typed exception for an `Error` the run sent."""
    return StageUnresponsiveError(code, message) if code == ERROR_STAGE_UNRESPONSIVE else RequestError(code, message)


LIVENESS_CHECK_S = 0.25  # how often a waiting client checks that the supervisor process is still there


@dataclass
class GenerateResult:
    tokens: list[int]
    finish_reason: str
    timing: dict


def ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def not_up_message(rd: RunDir) -> str:
    """Why the run of an existing run dir is not up: stopped (when, why), dead, or never started."""
    name = rd.name
    try:
        rec, state = rd.read_pid(), rd.read_state() or {}
    except RunDirError as e:
        return f"run {name!r} is not up ({e})"
    if rec is not None:
        return (f"run {name!r} is not up: its supervisor (pid {rec[0]}) died without stopping it "
                f"(`coli down --name {name}` cleans up)")
    if state.get("state") == "stopped":
        return (f"run {name!r} is not up: it stopped {ago(state.get('stopped', time.time()))} ago "
                f"({state.get('reason', 'no reason recorded')}); start it with `coli up --name {name}`")
    return f"run {name!r} is not up (start it with `coli up --name {name}`)"


class Client:
    def __init__(self, name: str = "default", base: str | None = None, timeout: float = 10.0):
        try:
            self.rd = RunDir(name, base, create=False)
        except RunDirError:
            raise RunNotFound(f"no run named {name!r} is up (start one with `coli up --name {name}`)") from None
        if not self.rd.is_live():
            raise RunNotFound(not_up_message(self.rd))
        self.name = name
        self.supervisor = self.rd.read_pid()  # (pid, start time): who must stay alive while we wait
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, self.rd.endpoint("client"), bind=False,
                                identity=f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
        send(self.sock, make_hello("client"))
        msg = self._recv(timeout, what="the supervisor's greeting")
        if isinstance(msg, Error):
            raise request_error(msg.code, msg.message)
        if not isinstance(msg, Ready):
            raise ColiError(f"unexpected {type(msg).__name__} from the supervisor during the handshake")
        self.info = dict(msg.info)

    def _recv(self, timeout: float | None, what: str):
        # wait in short slices, checking between them that the supervisor is alive: a SIGKILLed one
        # sends nothing, and the caller must hear of it at once, not when `timeout` runs out
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = LIVENESS_CHECK_S if deadline is None else min(LIVENESS_CHECK_S, deadline - time.monotonic())
            if left > 0 and self.sock.poll(int(left * 1000) or 1):
                break
            self._check_supervisor()
            if deadline is not None and time.monotonic() >= deadline:
                raise ColiError(f"run {self.name!r} did not answer {what} within {timeout:.0f} s")
        try:
            return recv(self.sock)
        except ProtocolError as e:
            raise ColiError(f"bad message from run {self.name!r}: {e}") from None

    def _check_supervisor(self) -> None:
        from coli.protocol.rundir import _alive, process_stopped

        if self.supervisor is None:
            return
        pid = self.supervisor[0]
        if not _alive(*self.supervisor):
            raise RunGone(f"run {self.name!r} is gone: its supervisor (pid {pid}) died without "
                          f"stopping the run (`coli down --name {self.name}` cleans up what is left)")
        if not process_stopped(pid):
            self._stopped_since = None
            return
        now = time.monotonic()
        self._stopped_since = getattr(self, "_stopped_since", None) or now
        limit = float(getattr(self, "info", {}).get("stage_timeout_s", 5.0))  # the run's own --stage-timeout
        if now - self._stopped_since >= limit:
            self._stopped_since = None
            raise RunUnresponsive(f"run {self.name!r} is unresponsive: its supervisor (pid {pid}) has been stopped "
                                  f"for {limit:g} s (SIGSTOP or Ctrl-Z; SIGCONT resumes it)")

    def stream(self, prompt_ids: list[int], max_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
               session: str | None = None, new_session: bool = False, ephemeral: bool = False,
               request_id: str | None = None, token_timeout: float | None = 300.0,
               mtp: str | None = None) -> Iterator[int | Done]:
        """Yields token ids as they are generated, then the Done message. Raises StageDeadError or
        RequestError. Closing the iterator early cancels the request."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        try:
            req = GenerateRequest(rid, list(prompt_ids), max_tokens, temperature, top_p, top_k, seed, greedy,
                                  ignore_eos, session, new_session, ephemeral, mtp=mtp)
        except ValueError as e:
            raise ColiError(f"invalid request: {e}") from None
        send(self.sock, req)
        finished = False
        try:
            while True:
                msg = self._recv(token_timeout, what=f"request {rid}")
                if isinstance(msg, Token) and msg.request_id == rid:
                    yield msg.token_id
                elif isinstance(msg, Done) and msg.request_id == rid:
                    finished = True
                    yield msg
                    return
                elif isinstance(msg, StageDead):
                    finished = True
                    raise StageDeadError(msg.stage, msg.reason)
                elif isinstance(msg, Error) and msg.request_id in (rid, None):
                    finished = True
                    raise request_error(msg.code, msg.message)
        finally:
            if not finished:
                try:
                    send(self.sock, Cancel(rid), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def generate(self, prompt_ids: list[int], max_tokens: int, **kw) -> GenerateResult:
        tokens: list[int] = []
        done = None
        for item in self.stream(prompt_ids, max_tokens, **kw):
            if isinstance(item, Done):
                done = item
            else:
                tokens.append(item)
        return GenerateResult(tokens, done.finish_reason, dict(done.timing))

    def wait_done(self, request_id: str, timeout: float = 5.0) -> Done | None:
        """After a stream was closed early (which cancels it): wait for that request's Done (finish_reason
        "cancelled", with its timing), skipping its last Tokens; None if it does not come within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                return None
            try:
                msg = recv(self.sock)
            except ProtocolError:
                continue
            if isinstance(msg, (Done, Error)) and msg.request_id == request_id:
                return msg if isinstance(msg, Done) else None
            if isinstance(msg, StageDead):
                raise StageDeadError(msg.stage, msg.reason)

    def drop_session(self, name: str) -> None:
        """Ask the executor to forget a session (its KV cache in memory and its file); no reply."""
        try:
            send(self.sock, DropSession(name), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def status(self, timeout: float = 5.0) -> dict:
        rid = f"st-{uuid.uuid4().hex[:12]}"
        send(self.sock, StatusRequest(rid))
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(max(0.01, deadline - time.monotonic()), what="the status request")
            if isinstance(msg, StatusReply) and msg.request_id == rid:
                return dict(msg.info)

    def down(self, reason: str = "", wait: float = 30.0) -> None:
        pid = (self.rd.read_pid() or (None,))[0]
        send(self.sock, Shutdown(reason or "requested by coli down"))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not self.rd.is_live():
                return
            time.sleep(0.05)
        raise ColiError(f"run {self.name!r} (supervisor pid {pid}) did not stop within {wait:.0f} s")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
