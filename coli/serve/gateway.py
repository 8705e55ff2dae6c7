"""The HTTP gateway (`coli serve`): an OpenAI-compatible API in front of a run, on Starlette + uvicorn.

    GET  /health                 200 when the run answers, 503 when it does not
    GET  /metrics                Prometheus text: the gateway's requests/latency + every stage's stats
    GET  /v1/models              the one model this run serves
    POST /v1/chat/completions    messages -> the model's chat template -> tokens (SSE with "stream": true)
    POST /v1/completions         a prompt string or token ids
    POST /v1/messages            the Anthropic Messages API (same template, tools and reasoning as chat)
    POST /v1/messages/count_tokens

The gateway is a client of the run (see `coli.serve.aclient.AsyncClient`): prompts are rendered and tokenised
here with the same modules `coli chat` uses (`coli.chat_template`, `coli.tokenizer`, from the run's
container directory), token ids go to the supervisor, which queues requests round-robin across its
client connections and admits up to `coli up --max-batch` of them at once into the executor's batch. The gateway opens one connection per
end user (the request's `user` field, else the client's address), so one user's burst of requests
does not starve another's; one user's requests run in arrival order. Every HTTP request is its own
request at the run and is cancelled on its own: a client that hangs up (mid-stream or still queued)
cancels it, and so does a `stop` string found in the text.

Every failure a client can cause is a 4xx with an OpenAI-style error object; the run being down or a
stage dying is a 503; the server keeps serving either way."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq.asyncio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coli import __version__
from coli.serve import console
from coli.serve.body import read_json
from coli.serve.aclient import AsyncClient, ClientTooSlow, RequestStream, RunGone
from coli.serve.client import RequestError, RunNotFound, StageDeadError
from coli.errors import ColiError
from coli.serve.metrics import CONTENT_TYPE, Counter, Histogram, stage_stats_lines
from coli.serve.anthropic_api import error_body, new_message_id, parse_messages
from coli.serve.chat_stream import AnthropicFormat, OpenAIChatFormat, anthropic_message_object, openai_chat_object
from coli.serve.chat_prompt import render_chat
from coli.serve.glm_output import OutputParser
from coli.serve.openai_api import (ApiError, Params, completion_chunk, completion_response, parse_chat,
                                   parse_completion, template_kwargs, usage_chunk)
from coli.serve.tools import ToolSpec, openai_tools
from coli.protocol.messages import Done
from coli.serve.textstream import TextAssembler
from coli.serve.tokenize_pool import TokenizePool, TokenizerWorkerDied

_FALLBACK_MAX_TOKENS = 512  # only for a run that does not report its context length


@dataclass
class GatewayConfig:
    run_name: str = "default"
    run_base: str | None = None
    api_key: str | None = None
    model_id: str | None = None          # default: the run's model directory name ("demo" for the demo)
    default_max_tokens: int | None = None  # a request without max_tokens: None = up to the context limit
    max_body_bytes: int = 4 << 20        # `coli serve --max-request-mb`
    max_stream_backlog: int = 4096       # tokens a streaming client may leave unread before it is stopped
    tokenize_workers: int = 1            # processes that encode big prompts off the event loop
    token_timeout: float = 600.0         # seconds without a token (queue wait included) before a 504
    default_mtp: str | None = None       # `coli serve --mtp` (protocol MTP_MODES) for a request without "mtp";
                                         # None: the field is left out and the run's `coli up --mtp` applies
    max_lanes: int = 64                  # end-user connections kept open at once
    connect_timeout: float = 10.0


def _mtp_of(p: Any, default: str | None) -> dict:
    """The request's MTP choice (the body's "mtp"), else the gateway's (`coli serve --mtp`), else nothing: a request
    that leaves the field out gets the run's `coli up --mtp`."""
    mtp = getattr(p, "mtp", None)
    if mtp is None:
        mtp = default
    return {"mtp": mtp} if mtp is not None else {}


class ClientGone(Exception):
    """The HTTP client hung up before its answer was ready."""


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _anthropic_error(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status)


def _run_error(e: BaseException) -> ApiError:
    """A failure reported by the run (or its absence) as the HTTP error a client gets."""
    if isinstance(e, (RunNotFound, RunGone)):
        return ApiError(503, str(e), "service_unavailable", code="run_unavailable")
    if isinstance(e, ClientTooSlow):
        return ApiError(429, f"{e}: read the stream as it comes, or raise `coli serve --max-stream-backlog` "
                             f"(now {e.backlog})", "client_too_slow", code="stream_backlog_full")
    if isinstance(e, TokenizerWorkerDied):
        return ApiError(503, str(e), "service_unavailable", code="tokenizer_died")
    if isinstance(e, StageDeadError):
        return ApiError(503, str(e), "service_unavailable", code="stage_dead")
    if isinstance(e, RequestError):
        if e.code == "bad_request":
            msg = str(e).split(": ", 1)[-1]
            code = "session_not_found" if "session" in msg and ("unknown" in msg or "no session" in msg) else None
            return ApiError(404 if code else 400, msg, param="session" if code else None, code=code or "bad_request")
        if e.code == "client_too_slow":  # the supervisor stopped it: the gateway fell behind reading
            return ApiError(429, str(e), "client_too_slow", code="client_too_slow")
        if e.code in ("shutdown", "stage_dead", "stage_unresponsive", "overloaded"):
            return ApiError(503, str(e), "service_unavailable", code=e.code)
        return ApiError(500, str(e), "server_error", code=e.code)
    if isinstance(e, TimeoutError):
        return ApiError(504, str(e), "timeout", code="token_timeout")
    return ApiError(500, f"{type(e).__name__}: {e}", "server_error", code="internal")


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class Gateway:
    def __init__(self, cfg: GatewayConfig, log: Any = None, connect: Callable | None = None):
        self.cfg = cfg
        self.log = log
        self._connect = connect or AsyncClient.connect  # the run; a ScriptedRun's connect in tests
        self.ctx: zmq.asyncio.Context | None = None
        self.lanes: "OrderedDict[str, AsyncClient]" = OrderedDict()
        self._lane_lock = asyncio.Lock()
        self.info: dict = {}
        self.container: str | None = None
        self.tok = None
        self.tokenize: TokenizePool | None = None
        self.template = None
        self.t_start = time.time()
        self.on_run_gone: Callable[[], None] | None = None
        self._watch_task: asyncio.Task | None = None
        m = self.m = {
            "requests": Counter("coli_gateway_requests_total", "HTTP requests answered, by endpoint and status code"),
            "latency": Histogram("coli_gateway_request_duration_seconds",
                                 "time from request to the last byte of the answer, by endpoint"),
            "ttft": Histogram("coli_gateway_time_to_first_token_seconds",
                              "time from request to the first generated token (queue wait included)"),
            "prompt": Counter("coli_gateway_prompt_tokens_total", "prompt tokens of accepted generation requests"),
            "completion": Counter("coli_gateway_completion_tokens_total", "tokens generated for clients"),
            "disconnects": Counter("coli_gateway_client_disconnects_total",
                                   "requests cancelled because the HTTP client went away"),
            "in_flight": Counter("coli_gateway_requests_in_flight", "generation requests being served now", "gauge"),
            "lanes": Counter("coli_gateway_connections", "open connections to the run (one per end user)", "gauge"),
            "up": Counter("coli_gateway_run_up", "1 if the run answered the last status request", "gauge"),
        }
        m["in_flight"].set(0)

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        await self.lane("")
        self._watch_task = asyncio.create_task(self._watch_run())

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        for c in list(self.lanes.values()):
            await c.close()
        self.lanes.clear()
        if self.tokenize is not None:
            self.tokenize.close()
        if self.ctx is not None:
            self.ctx.term()

    async def _watch_run(self) -> None:
        """Tell the owner (`coli serve --exit-with-run`) when the run stops."""
        from coli.protocol.rundir import RunDir

        while True:
            await asyncio.sleep(1.0)
            try:
                live = RunDir(self.cfg.run_name, self.cfg.run_base, create=False).is_live()
            except Exception:
                live = False
            if not live and self.on_run_gone is not None:
                self.on_run_gone()
                return

    def _adopt(self, info: dict) -> None:
        from coli.chat_template import load_chat_template
        from coli.tokenizer import load_tokenizer

        self.info = dict(info)
        container = info.get("container")
        if container != self.container:
            self.container = container
            self.tok = load_tokenizer(container) if container else None
            if self.tokenize is not None:
                self.tokenize.close()
            self.tokenize = TokenizePool(self.tok, self.cfg.tokenize_workers) if self.tok is not None else None
            self.template = load_chat_template(container) if container else None

    async def lane(self, key: str) -> AsyncClient:
        """The connection to the run for end user `key` (made, or made again after the run restarted)."""
        c = self.lanes.get(key)
        if c is not None and c.alive:
            self.lanes.move_to_end(key)
            return c
        async with self._lane_lock:
            c = self.lanes.get(key)
            if c is not None and c.alive:
                return c
            if c is not None:
                await c.close()
                del self.lanes[key]
            c = await self._connect(self.cfg.run_name, self.cfg.run_base, self.cfg.connect_timeout,
                                          ctx=self.ctx, tag="gateway")
            self._adopt(c.info)
            self.lanes[key] = c
            for k in [k for k, v in self.lanes.items() if k != key and k != "" and v.in_flight == 0]:
                if len(self.lanes) <= self.cfg.max_lanes:
                    break
                await self.lanes.pop(k).close()
            self.m["lanes"].set(len(self.lanes))
            return c

    @property
    def model_id(self) -> str:
        if self.cfg.model_id:
            return self.cfg.model_id
        m = str(self.info.get("model") or "demo")
        return Path(m).name or m

    # ---- plumbing -------------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        key = self.cfg.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        x_key = request.headers.get("x-api-key")  # how Anthropic clients send it
        if not ((scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()))
                or (x_key is not None and hmac.compare_digest(x_key.strip().encode(), key.encode()))):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           "invalid_request_error", code="invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.model_id!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def _record(self, endpoint: str, status: int, t0: float) -> None:
        self.m["requests"].inc(endpoint=endpoint, code=str(status))
        self.m["latency"].observe(time.monotonic() - t0, endpoint=endpoint)

    def _log(self, **fields) -> None:
        if self.log is not None:
            self.log.info("request", **fields)

    async def _race(self, request: Request, coro, stream: RequestStream | None):
        """Run `coro`; if the HTTP client hangs up first, cancel it (and the run's request)."""
        task = asyncio.ensure_future(coro)
        disc = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, disc}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            if stream is not None:
                stream.cancel()
            raise
        finally:
            disc.cancel()
        if task in done:
            return task.result()
        task.cancel()
        if stream is not None:
            stream.cancel()
        raise ClientGone()

    async def _encode(self, text: str, param: str) -> list[int]:
        """Tokenise (big prompts in a worker process, off the event loop); a prompt longer than the
        context is refused here without shipping its ids back."""
        ctx = int(self.info.get("max_position_embeddings") or 0) or None
        ids = await self.tokenize.encode(text, ctx)
        if isinstance(ids, int):
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your prompt is "
                                f"{ids} tokens. Please shorten it.", param=param, code="context_length_exceeded")
        return ids

    def _max_tokens(self, n_prompt: int, p: Params, param: str) -> int:
        if n_prompt == 0:
            raise ApiError(400, "the prompt is empty", param=param, code="empty_prompt")
        ctx = int(self.info.get("max_position_embeddings") or 0)
        if not ctx:
            return p.max_tokens or self.cfg.default_max_tokens or _FALLBACK_MAX_TOKENS
        if n_prompt >= ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your prompt is "
                                f"{n_prompt} tokens. Please shorten it.", param=param, code="context_length_exceeded")
        room = ctx - n_prompt
        if p.max_tokens is not None and p.max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{n_prompt + p.max_tokens} tokens ({n_prompt} in the prompt, {p.max_tokens} for the "
                                f"completion). Please reduce the prompt or {p.max_tokens_param}.",
                           param=p.max_tokens_param, code="context_length_exceeded")
        return p.max_tokens or min(room, self.cfg.default_max_tokens or room)

    # ---- endpoints ------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            c = await self.lane("")
            st = await c.status(timeout=3.0)
            self.m["up"].set(1)
            body = {"status": "ok", "run": self.cfg.run_name, "model": self.model_id, "queued": st.get("queued"),
                    "stages": {n: s.get("state") for n, s in (st.get("stages") or {}).items()},
                    "gateway_version": __version__}
            code = 200
        except (ColiError, OSError) as e:
            self.m["up"].set(0)
            body, code = {"status": "unavailable", "run": self.cfg.run_name, "error": str(e)}, 503
        self._record("/health", code, t0)
        return JSONResponse(body, status_code=code)

    async def metrics(self, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            self._auth(request)
        except ApiError as e:
            self._record("/metrics", e.status, t0)
            return _error_response(e)
        stats: dict = {}
        try:
            c = await self.lane("")
            st = await c.status(timeout=3.0)
            stats = st.get("stats") or {}
            self.m["up"].set(1)
        except (ColiError, OSError):
            self.m["up"].set(0)
        self._record("/metrics", 200, t0)
        lines = [f"# HELP coli_gateway_uptime_seconds seconds since the gateway started",
                 f"# TYPE coli_gateway_uptime_seconds gauge",
                 f"coli_gateway_uptime_seconds {time.time() - self.t_start:.3f}"]
        for metric in self.m.values():
            lines.extend(metric.render())
        lines.extend(stage_stats_lines(stats))
        return Response("\n".join(lines) + "\n", media_type=CONTENT_TYPE)

    async def api_stats(self, request: Request) -> Response:
        """The run's latest stage stats (what `coli stats --json` shows) for the console's engine page."""
        t0 = time.monotonic()
        try:
            self._auth(request)
            c = await self.lane("")
            st = await c.status(timeout=3.0)
        except ApiError as e:
            self._record("/api/stats", e.status, t0)
            return _error_response(e)
        except (ColiError, OSError) as e:
            err = _run_error(e)
            self._record("/api/stats", err.status, t0)
            return _error_response(err)
        self._record("/api/stats", 200, t0)
        return JSONResponse({"t": time.time(), "run": self.cfg.run_name, "model": self.model_id,
                             "queued": st.get("queued") or 0, "running": st.get("running") or 0,
                             "in_flight": int(self.m["in_flight"].values.get((), 0)),
                             "stats": st.get("stats") or {}})

    def _model_obj(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": int(self.t_start), "owned_by": "colistream",
                "max_model_len": self.info.get("max_position_embeddings")}

    async def models(self, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            self._auth(request)
            if not self.info:
                await self.lane("")
        except ApiError as e:
            self._record("/v1/models", e.status, t0)
            return _error_response(e)
        except ColiError as e:
            err = _run_error(e)
            self._record("/v1/models", err.status, t0)
            return _error_response(err)
        self._record("/v1/models", 200, t0)
        return JSONResponse({"object": "list", "data": [self._model_obj()]})

    async def model(self, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            self._auth(request)
            self._check_model(request.path_params["model_id"])
        except ApiError as e:
            self._record("/v1/models", e.status, t0)
            return _error_response(e)
        self._record("/v1/models", 200, t0)
        return JSONResponse(self._model_obj())

    async def chat(self, request: Request) -> Response:
        return await self._endpoint(request, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._endpoint(request, "/v1/completions")

    async def messages(self, request: Request) -> Response:
        return await self._endpoint(request, "/v1/messages")

    async def count_tokens(self, request: Request) -> Response:
        t0 = time.monotonic()
        endpoint = "/v1/messages/count_tokens"
        try:
            self._auth(request)
            body = await read_json(request, self.cfg.max_body_bytes)
            if not self.info:
                await self.lane("")
            messages, p, spec, kwargs = parse_messages(body, count_only=True)
            self._check_model(p.model)
            text, _ = self._render(messages, spec, kwargs, "toolu_")
            n = len(await self._encode(text, "messages"))
        except ApiError as e:
            return self._fail(endpoint, e, t0, {"endpoint": endpoint}, _anthropic_error)
        except (ColiError, OSError) as e:
            return self._fail(endpoint, _run_error(e), t0, {"endpoint": endpoint}, _anthropic_error)
        self._record(endpoint, 200, t0)
        return JSONResponse({"input_tokens": n})

    def _render(self, messages: list[dict], spec: ToolSpec, kwargs: dict, id_prefix: str) -> tuple[str, OutputParser]:
        if self.tok is None or self.template is None:
            raise ApiError(400, f"model {self.model_id!r} has no tokenizer.json or chat template: use "
                                f"/v1/completions with token ids", code="no_chat_template")
        return render_chat(self.template, self.model_id, messages, spec, kwargs, id_prefix)

    async def _prepare(self, endpoint: str, body: Any) -> tuple[list[int], Params, str, OutputParser | None]:
        """A request body -> (prompt ids, params, echo text, the output parser for chat answers)."""
        if endpoint == "/v1/completions":
            prompt, echo, p = parse_completion(body)
            self._check_model(p.model)
            if isinstance(prompt, str):
                if self.tok is None:
                    raise ApiError(400, f"model {self.model_id!r} has no tokenizer.json: send the prompt as "
                                        f"token ids", param="prompt", code="no_tokenizer")
                return await self._encode(prompt, "prompt"), p, prompt if echo else "", None
            prompt_ids = list(prompt)
            vocab = int(self.info.get("vocab_size") or 0)
            if vocab and max(prompt_ids) >= vocab:
                raise ApiError(400, f"token id {max(prompt_ids)} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
            echo_text = (self.tok.decode(prompt_ids) if self.tok is not None else "") if echo else ""
            return prompt_ids, p, echo_text, None
        if endpoint == "/v1/messages":
            messages, p, spec, kwargs = parse_messages(body)
            prefix = "toolu_"
        else:
            messages, p = parse_chat(body)
            spec, kwargs, prefix = openai_tools(body), template_kwargs(body.get("chat_template_kwargs")), "call_"
        self._check_model(p.model)
        text, parser = self._render(messages, spec, kwargs, prefix)
        return await self._encode(text, "messages"), p, "", parser

    async def _endpoint(self, request: Request, endpoint: str) -> Response:
        t0 = time.monotonic()
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/messages": "messages"}[endpoint]
        rid = {"chat": lambda: f"chatcmpl-{uuid.uuid4().hex}", "completion": lambda: f"cmpl-{uuid.uuid4().hex}",
               "messages": new_message_id}[kind]()
        shape = _anthropic_error if kind == "messages" else _error_response
        fields: dict[str, Any] = {"request_id": rid, "endpoint": endpoint,
                                  "client": request.client.host if request.client else None}
        try:
            self._auth(request)
            body = await read_json(request, self.cfg.max_body_bytes)
            if not self.info:
                await self.lane("")
            prompt_ids, p, echo_text, parser = await self._prepare(endpoint, body)
            max_tokens = self._max_tokens(len(prompt_ids), p, "prompt" if kind == "completion" else "messages")
            fields.update(prompt_tokens=len(prompt_ids), max_tokens=max_tokens, stream=p.stream, session=p.session)
            lane = await self.lane(p.user or (request.client.host if request.client else "?"))
            stream = await lane.submit(prompt_ids, max_tokens, greedy=p.greedy, temperature=p.temperature,
                                       top_p=p.top_p, top_k=p.top_k, seed=p.seed, ignore_eos=p.ignore_eos,
                                       session=p.session, new_session=p.new_session, request_id=rid,
                                       max_backlog=self.cfg.max_stream_backlog if p.stream else None,
                                       **_mtp_of(p, self.cfg.default_mtp))
        except ApiError as e:
            return self._fail(endpoint, e, t0, fields, shape)
        except (ColiError, OSError) as e:
            return self._fail(endpoint, _run_error(e), t0, fields, shape)

        self.m["in_flight"].inc(1)
        self.m["prompt"].inc(len(prompt_ids), endpoint=endpoint)
        g = _Generation(self, endpoint, rid, p, stream, len(prompt_ids), t0, fields, parser)
        try:
            first = await self._race(request, g.next(), stream)
        except ClientGone:
            return g.gone()
        except (ColiError, TimeoutError, OSError) as e:
            return g.failed(_run_error(e), shape)
        if p.stream:
            if kind == "completion":
                body_iter = g.sse(first, echo_text)
            else:
                fmt = (OpenAIChatFormat if kind == "chat" else AnthropicFormat)(g, self.model_id)
                body_iter = g.sse_chat(first, fmt)
            return StreamingResponse(body_iter, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": rid})
        try:
            await self._race(request, g.collect(first), stream)
        except ClientGone:
            return g.gone()
        except (ColiError, TimeoutError, OSError) as e:
            return g.failed(_run_error(e), shape)
        if kind == "completion":
            ids = g.asm.token_ids if p.return_token_ids else None
            obj = completion_response(rid, self.model_id, p.created, echo_text + g.asm.text, g.finish, g.n_prompt,
                                      g.n, ids)
        else:
            obj = (openai_chat_object if kind == "chat" else anthropic_message_object)(g, self.model_id, g.events)
        g.done(200)
        return JSONResponse(obj, headers={"X-Request-Id": rid})

    def _fail(self, endpoint: str, e: ApiError, t0: float, fields: dict,
              shape: Callable[[ApiError], Response] | None = None) -> Response:
        self._record(endpoint, e.status, t0)
        self._log(**fields, status=e.status, error=e.message, total_s=round(time.monotonic() - t0, 4))
        return (shape or _error_response)(e)


_FINISH = {"stop": "stop", "length": "length", "cancelled": "cancelled", "error": "error"}


class _Generation:
    """One accepted generation request: its token stream, text assembly, counters and the one log line."""

    def __init__(self, gw: Gateway, endpoint: str, rid: str, p: Params, stream: RequestStream, n_prompt: int,
                 t0: float, fields: dict, parser: OutputParser | None = None):
        self.gw, self.endpoint, self.rid, self.p, self.stream = gw, endpoint, rid, p, stream
        self.parser = parser  # chat answers: text -> reasoning / content / tool calls
        self.events: list = []  # the parser's events so far (for the non-streamed answer)
        self.n_prompt, self.t0, self.fields = n_prompt, t0, fields
        self.asm = TextAssembler(gw.tok, gw.info.get("eos_token_ids") or (), p.stop)
        self.n = 0
        self.finish = "length"
        self.t_first: float | None = None
        self.closed = False

    async def next(self) -> int | Done:
        item = await self.stream.next(timeout=self.gw.cfg.token_timeout)
        if self.t_first is None:
            self.t_first = time.monotonic()
            self.gw.m["ttft"].observe(self.t_first - self.t0, endpoint=self.endpoint)
        return item

    def push(self, item: int | Done) -> tuple[str, bool]:
        """-> (text to release, finished)."""
        if isinstance(item, Done):
            self.finish = _FINISH.get(item.finish_reason, item.finish_reason)
            return self.asm.finish(), True
        self.n += 1
        text = self.asm.push(item)
        if self.asm.stopped:
            self.stream.cancel()  # the rest is not wanted: free the executor for the next request
            self.finish = "stop"
            return text, True
        return text, False

    def push_events(self, item: int | Done) -> tuple[list, bool]:
        """push() through the chat parser -> (its events, finished). A parser that has all it may take
        (parallel_tool_calls false and one call) finishes the request like a stop string."""
        text, finished = self.push(item)
        evs = self.parser.feed(text) if text else []
        if not finished and self.parser.done:
            self.stream.cancel()
            self.finish, finished = "stop", True
        if finished:
            evs += self.parser.finish()
        self.events.extend(evs)
        return evs, finished

    async def collect(self, first: int | Done) -> None:
        item = first
        while True:
            _, finished = self.push(item) if self.parser is None else self.push_events(item)
            if finished:
                return
            item = await self.next()

    async def sse_chat(self, first: int | Done, fmt):
        """A chat answer as server-sent events in `fmt`'s shape (OpenAI chunks or Anthropic events)."""
        status = 200
        try:
            for s in fmt.start():
                yield s
            item = first
            while True:
                evs, finished = self.push_events(item)
                ids = [item] if self.p.return_token_ids and not isinstance(item, Done) else None
                for s in fmt.events(evs, ids):
                    yield s
                if finished:
                    break
                item = await self.next()
            for s in fmt.end():
                yield s
        except (ColiError, TimeoutError, OSError) as e:
            err = _run_error(e)
            status = err.status
            self.stream.cancel()
            for s in fmt.error(err):
                yield s
        finally:
            if not self.stream.finished:  # the client hung up mid-stream (we are being cancelled)
                self.stream.cancel()
                self.gw.m["disconnects"].inc()
                status = 499
            self.done(status)

    async def sse(self, first: int | Done, echo_text: str):
        """A completion as server-sent events."""
        gw, p, rid, model = self.gw, self.p, self.rid, self.gw.model_id
        created = p.created
        status = 200

        def chunk(text: str, finish: str | None = None, ids: list[int] | None = None) -> str:
            return _sse(completion_chunk(rid, model, created, text, finish, ids))

        try:
            if echo_text:
                yield chunk(echo_text)
            item = first
            while True:
                text, finished = self.push(item)
                ids = [item] if p.return_token_ids and not isinstance(item, Done) else None
                if text or ids:
                    yield chunk(text, ids=ids)
                if finished:
                    break
                item = await self.next()
            yield chunk("", finish=self.finish)
            if p.include_usage:
                yield _sse(usage_chunk(rid, model, created, "text_completion", self.n_prompt, self.n))
            yield "data: [DONE]\n\n"
        except (ColiError, TimeoutError, OSError) as e:
            err = _run_error(e)
            status = err.status
            self.stream.cancel()
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            if not self.stream.finished:  # the client hung up mid-stream (we are being cancelled)
                self.stream.cancel()
                gw.m["disconnects"].inc()
                status = 499
            self.done(status)

    def gone(self) -> Response:
        self.gw.m["disconnects"].inc()
        self.done(499)
        return Response(status_code=499)

    def failed(self, e: ApiError, shape: Callable[[ApiError], Response] | None = None) -> Response:
        self.stream.cancel()
        self.done(e.status, e.message)
        return (shape or _error_response)(e)

    def done(self, status: int, error: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        gw = self.gw
        gw.m["in_flight"].inc(-1)
        gw.m["completion"].inc(self.n, endpoint=self.endpoint)
        gw._record(self.endpoint, status, self.t0)
        total = time.monotonic() - self.t0
        gw._log(**self.fields, status=status, completion_tokens=self.n, finish=self.finish if status == 200 else None,
                ttft_s=round(self.t_first - self.t0, 4) if self.t_first else None, total_s=round(total, 4),
                **({"error": error} if error else {}))


async def _not_found(request: Request, exc: HTTPException) -> Response:
    e = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                 "invalid_request_error", code="not_found" if exc.status_code == 404 else "method_not_allowed")
    return _error_response(e)


async def _server_error(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                                    code="internal"))


def create_app(cfg: GatewayConfig, log: Any = None, gateway: Gateway | None = None) -> Starlette:
    gw = gateway or Gateway(cfg, log)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    routes = [
        Route("/", console.chat_page, methods=["GET"]),
        Route("/engine", console.engine_page, methods=["GET"]),
        Route("/web/{name}", console.asset, methods=["GET"]),
        Route("/api/stats", gw.api_stats, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/metrics", gw.metrics, methods=["GET"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", gw.model, methods=["GET"]),
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/messages", gw.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", gw.count_tokens, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _not_found, Exception: _server_error})
    app.state.gateway = gw
    return app
