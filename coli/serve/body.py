"""Reading a request body as JSON, strictly: a size limit (413 naming the setting), one clear 400 for
anything that is not a JSON document, and no string that cannot be encoded — Python's json accepts
lone UTF-16 surrogates ("\\ud800"), which then fail deep inside the tokenizer or the response encoder."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from coli.serve.openai_api import ApiError


def _too_large(what: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {what}; this server takes at most {limit} bytes "
                         f"(`coli serve --max-request-mb`)", code="body_too_large")


def _bad_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def find_bad_string(doc: Any) -> str | None:
    """-> the path ('messages[0].content', 'stop[1]', a key as 'tools[0].<key>') of the first string
    holding a lone surrogate, or None. Iterative: the JSON may nest as deep as the parser allowed."""
    todo: list[tuple[Any, str]] = [(doc, "")]
    while todo:
        v, path = todo.pop()
        if isinstance(v, str):
            if _bad_unicode(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                if _bad_unicode(k):
                    return f"{path}.<key>" if path else "<key>"
                todo.append((x, p))
        elif isinstance(v, list):
            todo.extend((x, f"{path}[{i}]") for i, x in enumerate(v))
    return None


async def read_json(request: Request, limit: int) -> Any:
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise _too_large(f"{cl} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # a body without (or lying about) its length is cut off here
        size += len(chunk)
        if size > limit:
            raise _too_large(f"over {limit} bytes", limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")

    def no_constants(c: str):
        raise ValueError(f"{c} is not valid JSON")

    import json
    try:
        doc = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply", code="invalid_json") from None
    bad = find_bad_string(doc)
    if bad is not None:
        raise ApiError(400, f"'{bad}' holds a lone UTF-16 surrogate (like \\ud800), which is not valid Unicode; "
                            f"send well-formed UTF-8 text", param=bad, code="invalid_unicode")
    return doc
