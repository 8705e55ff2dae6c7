"""The web console: plain HTML/JS/CSS (coli/serve/web/, no build step, no third-party code) served by the
gateway — a chat page at `/` (streamed replies, markdown, reasoning folded) and an engine page at `/engine`
(the `coli stats` figures over time, from `GET /api/stats`). The pages hold no data and need no key; the
API calls they make do (the key is typed into the page and kept in the browser)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

WEB = Path(__file__).resolve().parent / "web"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}
FILES = {p.name: p for p in WEB.iterdir() if p.suffix in _TYPES} if WEB.is_dir() else {}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'"}


def _file(name: str) -> Response:
    p = FILES.get(name)
    if p is None:  # only the files shipped in web/, never a path a client makes up
        return JSONResponse({"error": {"message": f"no such console file: {name}", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status_code=404)
    return Response(p.read_bytes(), media_type=_TYPES[p.suffix], headers=_HEADERS)


async def chat_page(request: Request) -> Response:
    return _file("index.html")


async def engine_page(request: Request) -> Response:
    return _file("engine.html")


async def asset(request: Request) -> Response:
    return _file(request.path_params["name"])
