"""`coli serve`: the OpenAI-compatible HTTP gateway in front of a run (see coli/serve/gateway.py and
docs/serving.md). Starlette + uvicorn, on uvloop where it is installed."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from typing import Optional

import typer

from coli.cli.common import clean_errors
from coli.errors import ColiError

DEFAULT_HTTP = "127.0.0.1:8000"


def parse_http(spec: str) -> tuple[str, int]:
    """'[HOST:]PORT' -> (host, port); IPv6 hosts in brackets ('[::1]:8000'). The host defaults to 127.0.0.1."""
    s = spec.strip()
    host = "127.0.0.1"
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or not s[end + 1:].startswith(":"):
            raise ColiError(f"--http {spec!r}: write an IPv6 address as [ADDR]:PORT")
        host, port_s = s[1:end], s[end + 2:]
    elif ":" in s:
        host, _, port_s = s.rpartition(":")
        if ":" in host:
            raise ColiError(f"--http {spec!r}: write an IPv6 address as [ADDR]:PORT")
    else:
        port_s = s
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ColiError(f"--http {spec!r}: the port must be a number in 0..65535 (0 picks a free one)")
    return host or "127.0.0.1", int(port_s)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


STREAM_SNDBUF = 128 * 1024   # bytes asked for each connection's send buffer (see bind_socket)


def bind_socket(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ColiError(f"--http: cannot resolve host {host!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this send buffer. Bounded, so that a client that stops reading fills it after
    # a few thousand streamed tokens at most and --max-stream-backlog stops its request then; left to autotuning,
    # a loopback connection grows to tcp_wmem's maximum (4 MiB: ~16,000 SSE token events) and a stalled reader
    # goes unnoticed for a whole generation. 128 KiB (the kernel doubles it) is ~1 s of tokens at any decode rate.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ColiError(f"--http {host}:{port}: cannot listen there: {e.strerror} (pick another port with --http)") \
            from None
    sock.listen(2048)  # from here on connections wait in the backlog, so the URL can be announced now
    sock.set_inheritable(True)
    return sock


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from --api-key (or COLI_API_KEY) or from --api-key-file; a key on the command line is
    visible to every local user in `ps`, a file (mode 0600) or the environment is not."""
    if api_key is not None and api_key_file is not None:
        raise ColiError("give the API key once: --api-key (or COLI_API_KEY) or --api-key-file, not both")
    if api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                api_key = f.read().strip()
            mode = os.stat(api_key_file).st_mode
        except (OSError, UnicodeDecodeError) as e:
            raise ColiError(f"--api-key-file {api_key_file}: cannot read it: {getattr(e, 'strerror', None) or e}") \
                from None
        if not api_key:
            raise ColiError(f"--api-key-file {api_key_file}: the file is empty (write the key on its first line)")
        if "\n" in api_key:
            raise ColiError(f"--api-key-file {api_key_file}: the file holds more than one line (only the key)")
        if mode & 0o077:
            print(f"warning: --api-key-file {api_key_file} is readable by other users (chmod 600 it)",
                  file=sys.stderr, flush=True)
        return api_key
    if api_key is not None and not api_key.strip():
        raise ColiError("--api-key (or COLI_API_KEY) is empty")
    return api_key


API_KEY_HELP = ("Require 'Authorization: Bearer KEY' or 'x-api-key: KEY'. Prefer COLI_API_KEY or --api-key-file: "
                "a key on the command line is visible to every local user in `ps`.")
API_KEY_FILE_HELP = "Read the API key from this file (its first line; keep it chmod 600)."


def serve(
    name: str = typer.Option("default", "--name", help="Run name (the run must be up: `coli up`)."),
    http: str = typer.Option(DEFAULT_HTTP, "--http", help="[HOST:]PORT to listen on (0 = a free port). Binds "
                             "127.0.0.1 unless a host is given."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="COLI_API_KEY", help=API_KEY_HELP),
    api_key_file: Optional[str] = typer.Option(None, "--api-key-file", help=API_KEY_FILE_HELP),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id clients use (default: the model "
                                             "directory's name, 'demo' for the demo)."),
    default_max_tokens: Optional[int] = typer.Option(None, "--default-max-tokens", min=1,
                                                     help="max_tokens for requests that give none (default: up to "
                                                          "the context limit)."),
    wait: float = typer.Option(0.0, "--wait", min=0.0, help="Seconds to wait for the run to come up."),
    exit_with_run: bool = typer.Option(False, "--exit-with-run", help="Stop when the run stops."),
    token_timeout: float = typer.Option(600.0, "--token-timeout", min=1.0,
                                        help="Seconds without a token (queue wait included) before a 504."),
    max_request_mb: float = typer.Option(4.0, "--max-request-mb", min=0.001,
                                         help="Largest request body accepted (bigger ones get HTTP 413)."),
    max_stream_backlog: int = typer.Option(4096, "--max-stream-backlog", min=1,
                                           help="Tokens a streaming client may leave unread before its request "
                                                "is stopped with a client_too_slow error."),
    mtp: Optional[str] = typer.Option(None, "--mtp", metavar="off|on|N|auto",
                                      help="MTP speculative decoding for requests that do not say (their \"mtp\" "
                                           "field; docs/mtp.md). Default: the run's `coli up --mtp`."),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error."),
) -> None:
    """Serve a run over HTTP: OpenAI-compatible /v1/chat/completions (tools, reasoning), /v1/completions,
    /v1/models, the Anthropic Messages API /v1/messages, plus /health and /metrics (Prometheus) and a web
    console at /. The API key can come from --api-key, COLI_API_KEY or --api-key-file."""
    _serve(name, http, api_key, api_key_file, model_name, default_max_tokens, wait, exit_with_run, token_timeout,
           max_request_mb, max_stream_backlog, log_level, mtp)


@clean_errors
def _serve(name, http, api_key, api_key_file, model_name, default_max_tokens, wait, exit_with_run, token_timeout,
           max_request_mb, max_stream_backlog, log_level, mtp=None):
    import uvicorn

    from coli.model.mtp import mtp_mode
    from coli.serve.client import Client, RunNotFound
    from coli.serve.gateway import Gateway, GatewayConfig, create_app
    from coli.protocol.rundir import RunDir
    from coli.stages.common import configure_logging

    host, port = parse_http(http)
    api_key = read_api_key(api_key, api_key_file)
    mtp = mtp_mode(mtp) if mtp is not None else None     # a bad --mtp is refused before the run is asked
    deadline = time.monotonic() + wait
    while True:  # the run must answer before we listen (clean error instead of a server that only says 503)
        try:
            with Client(name) as c:
                info = c.info
            break
        except (RunNotFound, ColiError) as e:
            if time.monotonic() >= deadline:
                raise ColiError(f"{e}" + ("" if wait else " (or pass --wait SECONDS)")) from None
            time.sleep(0.2)
    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    log = configure_logging(RunDir(name, create=False).log_path("gateway"), "gateway", log_level)
    cfg = GatewayConfig(run_name=name, api_key=api_key, model_id=model_name, default_max_tokens=default_max_tokens,
                        token_timeout=token_timeout, max_body_bytes=int(max_request_mb * (1 << 20)),
                        max_stream_backlog=max_stream_backlog, default_mtp=mtp)
    gw = Gateway(cfg, log)
    app = create_app(cfg, log, gw)
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    config = uvicorn.Config(app, loop=loop, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            lifespan="on")
    server = uvicorn.Server(config)
    if exit_with_run:
        gw.on_run_gone = lambda: setattr(server, "should_exit", True)
    shown = f"[{host}]" if ":" in host else host
    model = model_name or (os.path.basename(str(info.get("model") or "demo")) or "demo")
    print(f"gateway for run {name!r} (model {model!r}) listening on http://{shown}:{port} "
          f"(loop {loop}; auth {'on' if api_key else 'off'}{f'; mtp {mtp}' if mtp else ''}) — OpenAI API at /v1, "
          f"/health, /metrics",
          file=sys.stderr, flush=True)
    if not _is_loopback(host) and not api_key:
        print(f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr, flush=True)
    log.info("listening", host=host, port=port, loop=loop, auth=bool(api_key), model=model, mtp=mtp)
    server.run(sockets=[sock])
    log.info("stopped")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
