"""The asyncio client of a run, for the HTTP gateway: one ZeroMQ DEALER connection (one client identity at
the supervisor) that carries many requests at once, demultiplexed by request id.

It speaks the same protocol as the blocking `coli.serve.client.Client` (HELLO -> READY, GenerateRequest,
Token... Done, Cancel, StatusRequest) through `zmq.asyncio`, so it runs on the gateway's event loop
(uvloop where available) without a thread per request. A reader task drains the socket continuously
(the supervisor drops a client whose queue fills up), and a watch task notices a run whose supervisor
is gone — which sends nothing — and fails every request in flight with `RunGone`.

Cancellation is per request: `RequestStream.cancel()` sends `Cancel(request_id)`; the supervisor drops
the request if it is queued, or stops it at the executor if it runs."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio

from coli.serve.client import (RequestError, RunGone, RunNotFound, StageDeadError,  # noqa: F401
                               StageUnresponsiveError, not_up_message, request_error)
from coli.errors import ColiError
from coli.protocol.codec import decode, encode
from coli.protocol.errors import ProtocolError, RunDirError
from coli.protocol.handshake import make_hello
from coli.protocol.messages import (Cancel, Done, Error, GenerateRequest, Message, Ready, StageDead, StatusReply,
                                    StatusRequest, Token)
from coli.protocol.rundir import RunDir
from coli.protocol.sockets import make_socket

__all__ = ["AsyncClient", "ClientTooSlow", "RequestStream", "RunGone", "RunNotFound", "RequestError",
           "StageDeadError"]

_HAS_NEW_SESSION = any(f.name == "new_session" for f in dataclasses.fields(GenerateRequest))


class ClientTooSlow(ColiError):
    """The consumer of a stream fell `backlog` tokens behind the run; the request was stopped there."""

    def __init__(self, request_id: str, backlog: int):
        super().__init__(f"request {request_id} was stopped: its reader fell {backlog} tokens behind the model")
        self.backlog = backlog


class RequestStream:
    """One request in flight. `await next()` returns a token id, then the Done message; it raises
    StageDeadError, RequestError, RunGone or ClientTooSlow. `cancel()` stops the request (idempotent).

    `max_backlog` bounds the tokens received but not yet taken with next(): a consumer that stops reading
    (an HTTP client that does not read its stream) would otherwise keep the executor generating into an
    ever-growing queue. When it is reached the request is cancelled at the run and, after the tokens
    already queued, next() raises ClientTooSlow — the reader learns why as soon as it catches up."""

    def __init__(self, client: "AsyncClient", request_id: str, max_backlog: int | None = None):
        self.client = client
        self.request_id = request_id
        self.max_backlog = max_backlog
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.cancelled = False

    async def next(self, timeout: float | None = None) -> int | Done:
        if self.finished and self.queue.empty():
            raise ColiError(f"request {self.request_id} already finished")
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout) if timeout else await self.queue.get()
        except asyncio.TimeoutError:
            raise TimeoutError(f"no token for request {self.request_id} within {timeout:.0f} s") from None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if isinstance(item, Done):
            self.finished = True
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> int | Done:
        if self.finished:
            raise StopAsyncIteration
        return await self.next()

    def cancel(self) -> None:
        """Stop the request at the run; tokens still on their way are dropped. Not a coroutine, so it
        also works where the caller is being cancelled itself (a client that hung up mid-stream)."""
        if self.finished or self.cancelled:
            return
        self.cancelled = True
        self.finished = True
        self.client._streams.pop(self.request_id, None)
        self.client._send_nowait(Cancel(self.request_id))


class AsyncClient:
    """`await AsyncClient.connect(name)`; then `await submit(...)` any number of times concurrently."""

    def __init__(self, rd: RunDir, name: str, ctx: zmq.asyncio.Context, owns_ctx: bool, identity: bytes):
        self.rd, self.name = rd, name
        self.ctx, self._owns_ctx = ctx, owns_ctx
        self.identity = identity
        self.sock = make_socket(ctx, zmq.DEALER, rd.endpoint("client"), bind=False, identity=identity)
        self.info: dict[str, Any] = {}
        self._streams: dict[str, RequestStream] = {}
        self._status: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._send_lock = asyncio.Lock()
        self.dead: BaseException | None = None
        self.closed = False
        self.t_connect = time.time()

    @classmethod
    async def connect(cls, name: str = "default", base: str | None = None, timeout: float = 10.0,
                      ctx: zmq.asyncio.Context | None = None, tag: str = "aclient",
                      watch_interval: float = 0.5) -> "AsyncClient":
        try:
            rd = RunDir(name, base, create=False)
        except RunDirError:
            raise RunNotFound(f"no run named {name!r} is up (start one with `coli up --name {name}`)") from None
        if not rd.is_live():
            raise RunNotFound(not_up_message(rd))
        identity = f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self = cls(rd, name, ctx or zmq.asyncio.Context(), ctx is None, identity)
        try:
            await self._send(make_hello("client"))
            msg = await self._recv_one(timeout, "the supervisor's greeting")
            if isinstance(msg, Error):
                raise RequestError(msg.code, msg.message)
            if not isinstance(msg, Ready):
                raise ColiError(f"unexpected {type(msg).__name__} from the supervisor during the handshake")
        except BaseException:
            await self.close()
            raise
        self.info = dict(msg.info)
        self._tasks = [asyncio.create_task(self._reader(), name=f"aclient-reader-{name}"),
                       asyncio.create_task(self._watch(watch_interval), name=f"aclient-watch-{name}")]
        return self

    # ---- wire ------------------------------------------------------------------------------------------
    async def _send(self, msg: Message, best_effort: bool = False, timeout: float = 5.0) -> None:
        if self.closed:
            if best_effort:
                return
            raise self.dead or RunGone(f"the connection to run {self.name!r} is closed")
        try:
            async with self._send_lock:
                await asyncio.wait_for(self.sock.send_multipart(encode(msg), copy=True), timeout)
        except (asyncio.TimeoutError, zmq.ZMQError) as e:
            if best_effort:
                return
            raise RunGone(f"run {self.name!r} does not take messages ({e or 'send timed out'})") from None

    def _send_nowait(self, msg: Message) -> None:
        """Queue `msg` without awaiting (zmq.asyncio sends at once when nothing else is queued)."""
        if self.closed:
            return
        try:
            fut = self.sock.send_multipart(encode(msg), copy=True)
        except zmq.ZMQError:
            return
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieve, never raise

    async def _recv_one(self, timeout: float, what: str) -> Message:
        try:
            frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        except asyncio.TimeoutError:
            raise ColiError(f"run {self.name!r} did not answer {what} within {timeout:.0f} s") from None
        try:
            return decode(frames)
        except ProtocolError as e:
            raise ColiError(f"bad message from run {self.name!r}: {e}") from None

    async def _reader(self) -> None:
        while not self.closed:
            try:
                frames = await self.sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                self._fail_all(RunGone(f"connection to run {self.name!r} failed: {e}"))
                return
            try:
                msg = decode(frames)
            except ProtocolError:
                continue  # a damaged message answers no one we can name; the request times out or finishes
            self._route(msg)

    def _route(self, msg: Message) -> None:
        if isinstance(msg, (Token, Done)) or (isinstance(msg, Error) and msg.request_id is not None):
            s = self._streams.get(msg.request_id)
            if s is None:
                return  # a cancelled request's late tokens
            if isinstance(msg, Token):
                if s.max_backlog and s.queue.qsize() >= s.max_backlog:
                    self._streams.pop(msg.request_id, None)  # its later tokens are dropped as a cancelled one's
                    s.cancelled = True
                    self._send_nowait(Cancel(msg.request_id))
                    s.queue.put_nowait(ClientTooSlow(msg.request_id, s.max_backlog))
                    return
                s.queue.put_nowait(msg.token_id)
            elif isinstance(msg, Done):
                self._streams.pop(msg.request_id, None)
                s.queue.put_nowait(msg)
            else:
                self._streams.pop(msg.request_id, None)
                s.queue.put_nowait(request_error(msg.code, msg.message))
        elif isinstance(msg, StatusReply):
            f = self._status.pop(msg.request_id, None)
            if f is not None and not f.done():
                f.set_result(dict(msg.info))
        elif isinstance(msg, StageDead):
            # sent once per request in flight; the run is going down either way
            self._fail_all(StageDeadError(msg.stage, msg.reason))
        elif isinstance(msg, Error):  # answers no request: the connection itself was refused
            self._fail_all(RequestError(msg.code, msg.message))

    async def _watch(self, interval: float) -> None:
        while not self.closed:
            await asyncio.sleep(interval)
            try:
                live = self.rd.is_live()
            except RunDirError:
                live = False
            if not live:
                pid = (self._pid_quietly() or ("?",))[0]
                self._fail_all(RunGone(f"run {self.name!r} is gone: its supervisor (pid {pid}) is not running"))
                return

    def _pid_quietly(self):
        try:
            return self.rd.read_pid()
        except RunDirError:
            return None

    def _fail_all(self, exc: BaseException) -> None:
        if self.dead is None:
            self.dead = exc
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s.queue.put_nowait(exc)
        waiters, self._status = self._status, {}
        for f in waiters.values():
            if not f.done():
                f.set_exception(exc)

    # ---- API -------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self.closed and self.dead is None

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def submit(self, prompt_ids: list[int], max_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
                     session: str | None = None, new_session: bool = False,
                     request_id: str | None = None, max_backlog: int | None = None,
                     mtp: str | None = None) -> RequestStream:
        if self.dead is not None:
            raise self.dead
        rid = request_id or f"req-{uuid.uuid4().hex}"
        extra = {"new_session": new_session} if _HAS_NEW_SESSION else {}
        try:
            req = GenerateRequest(rid, list(prompt_ids), max_tokens, temperature, top_p, top_k, seed, greedy,
                                  ignore_eos, session, **extra, **({"mtp": mtp} if mtp is not None else {}))
        except ValueError as e:
            raise RequestError("bad_request", str(e)) from None
        if rid in self._streams:
            raise RequestError("bad_request", f"request id {rid!r} is in use")
        stream = RequestStream(self, rid, max_backlog)
        self._streams[rid] = stream
        try:
            await self._send(req)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    async def status(self, timeout: float = 5.0) -> dict:
        if self.dead is not None:
            raise self.dead
        rid = f"st-{uuid.uuid4().hex[:12]}"
        fut = asyncio.get_running_loop().create_future()
        self._status[rid] = fut
        try:
            await self._send(StatusRequest(rid))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ColiError(f"run {self.name!r} did not answer the status request within {timeout:.0f} s") from None
        finally:
            self._status.pop(rid, None)

    async def close(self) -> None:
        if self.closed:
            return
        if self.dead is None:
            for s in list(self._streams.values()):  # tell the run to stop what this connection asked for
                await self._send(Cancel(s.request_id), best_effort=True, timeout=0.5)
        self.closed = True
        self._fail_all(RunGone(f"the connection to run {self.name!r} was closed"))
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(linger=200)  # long enough for those cancels to leave
        if self._owns_ctx:
            self.ctx.term()
