"""The client side of a run: connect to the supervisor's client socket, HELLO -> READY, then generate
(streaming tokens), ask for status, or ask the run to stop. Used by `coli chat`, `coli status`,
`coli down`, `coli stats` and the HTTP gateway."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import zmq

from coli.errors import ColiError
from coli.protocol.errors import ProtocolError, RunDirError
from coli.protocol.handshake import make_hello
from coli.protocol.messages import (Cancel, Done, Error, GenerateRequest, Ready, Shutdown, StageDead, StatusReply,
                                    StatusRequest, Token)
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


@dataclass
class GenerateResult:
    tokens: list[int]
    finish_reason: str
    timing: dict


class Client:
    def __init__(self, name: str = "default", base: str | None = None, timeout: float = 10.0):
        try:
            self.rd = RunDir(name, base, create=False)
        except RunDirError:
            raise RunNotFound(f"no run named {name!r} is up (start one with `coli up --name {name}`)") from None
        if not self.rd.is_live():
            raise RunNotFound(f"run {name!r} is not up (its supervisor is gone; `coli up --name {name}` cleans up)")
        self.name = name
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, self.rd.endpoint("client"), bind=False,
                                identity=f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
        send(self.sock, make_hello("client"))
        msg = self._recv(timeout, what="the supervisor's greeting")
        if isinstance(msg, Error):
            raise RequestError(msg.code, msg.message)
        if not isinstance(msg, Ready):
            raise ColiError(f"unexpected {type(msg).__name__} from the supervisor during the handshake")
        self.info = dict(msg.info)

    def _recv(self, timeout: float | None, what: str):
        if timeout is not None and not self.sock.poll(int(timeout * 1000)):
            raise ColiError(f"run {self.name!r} did not answer {what} within {timeout:.0f} s")
        try:
            return recv(self.sock)
        except ProtocolError as e:
            raise ColiError(f"bad message from run {self.name!r}: {e}") from None

    def stream(self, prompt_ids: list[int], max_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
               session: str | None = None, new_session: bool = False, request_id: str | None = None,
               token_timeout: float | None = 300.0) -> Iterator[int | Done]:
        """Yields token ids as they are generated, then the Done message. Raises StageDeadError or
        RequestError. Closing the iterator early cancels the request."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        try:
            req = GenerateRequest(rid, list(prompt_ids), max_tokens, temperature, top_p, top_k, seed, greedy,
                                  ignore_eos, session, new_session)
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
                    raise RequestError(msg.code, msg.message)
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
