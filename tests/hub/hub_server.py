"""A small Hugging Face Hub on 127.0.0.1 for the tests: the routes the real `huggingface_hub` client calls, with the
headers it checks (read from huggingface_hub 2.4's file_download.py / hf_api.py / utils/_http.py):

  GET  /api/models/ORG/REPO[/revision/REV]?blobs=true   model_info: sha, siblings with size, blobId, lfs.sha256
  HEAD /ORG/REPO/resolve/REV/FILE                         X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size
  GET  /ORG/REPO/resolve/REV/FILE                         the bytes; Range: bytes=N- answered 206 (resume)

Errors as the Hub gives them: 401 + X-Error-Code RepoNotFound for a missing repo, 401/403 + GatedRepo for a gated
repo without/with a wrong token, 404 + RevisionNotFound / EntryNotFound. Faults to inject: a file whose served
bytes differ from the listing (`corrupt`), a connection dropped once after N bytes (`drop_once`), a delay per
chunk (`chunk_delay`) so a test can kill a download half-way. Every request is recorded."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

_TEXT = (".json", ".txt", ".jinja", ".md", ".model", ".tiktoken")


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: dict[str, str] = field(default_factory=dict)
    token: str | None = None          # gated: this bearer token is required
    listed_size: dict[str, int] = field(default_factory=dict)   # sizes the listing claims instead of the real ones
    older: dict[str, dict[str, bytes]] = field(default_factory=dict)   # earlier commits, still served by hash

    def push(self, files: dict[str, bytes], commit: str) -> None:
        """A new commit on main; the old one stays reachable by its hash (as on the Hub)."""
        self.older[self.commit] = self.files
        self.files, self.commit = files, commit

    def files_at(self, commit: str) -> dict[str, bytes]:
        return self.files if commit == self.commit else self.older[commit]

    def lfs(self, name: str) -> bool:
        return not name.endswith(_TEXT)


def repo_from_dir(d: Path, **kw) -> Repo:
    return Repo({p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}, **kw)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.corrupt: dict[tuple[str, str], int] = {}     # (repo, file) -> offset of a flipped byte when served
        self.drop_once: dict[tuple[str, str], int] = {}   # (repo, file) -> bytes sent before the connection drops
        self.fail_status: int | None = None                 # answer every request with this status (endpoint down)
        self.chunk_delay = 0.0
        self.chunk = 1 << 16
        self.requests: list[tuple[str, str, str | None]] = []   # (method, path, Range header)
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def gets(self, name: str) -> list[str | None]:
        """Range headers of the GETs of a file (None: from the start)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name) and "/resolve/" in p]

    def _handler(self):
        server = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, headers: dict | None = None, body: bytes = b"") -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, str(v))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _error(self, code: int, error_code: str | None, message: str = "") -> None:
                h = {"X-Error-Message": message or error_code or "error"}
                if error_code:
                    h["X-Error-Code"] = error_code
                self._send(code, h, json.dumps({"error": message or error_code}).encode())

            def _repo(self, repo_id: str) -> Repo | None:
                repo = server.repos.get(repo_id)
                if repo is None:
                    self._error(401, "RepoNotFound", "Repository not found")
                    return None
                if repo.token is not None:
                    auth = self.headers.get("Authorization")
                    if auth is None:
                        self._error(401, "GatedRepo", "Access to this model is restricted")
                        return None
                    if auth != f"Bearer {repo.token}":
                        self._error(403, "GatedRepo", "Access to this model is restricted")
                        return None
                return repo

            def _commit(self, repo: Repo, rev: str) -> str | None:
                if rev in ("main", repo.commit):
                    return repo.commit
                if rev in repo.older:
                    return rev
                if rev in repo.branches:
                    return repo.branches[rev]
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None

            def _repo_at(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
                """(repo, commit) for a listing or a file request, or None with the Hub's error already sent."""
                repo = self._repo(repo_id)
                if repo is None:
                    return None
                commit = self._commit(repo, rev)
                return None if commit is None else (repo, commit)

            def do_HEAD(self):
                self._serve()

            def do_GET(self):
                self._serve()

            def _serve(self):
                path = unquote(urlparse(self.path).path)
                with server.lock:
                    server.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if server.fail_status is not None:
                    return self._error(server.fail_status, None, "Service Unavailable")
                if parts[:2] == ["api", "models"]:
                    return self._api(parts[2:])
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
                self._error(404, None, "no such route")

            def _api(self, rest: list[str]):
                repo_id, rev = "/".join(rest[:2]), "main"
                if len(rest) == 4 and rest[2] == "revision":
                    rev = rest[3]
                found = self._repo_at(repo_id, rev)
                if found is None:
                    return
                repo, commit = found
                siblings = []
                for name, data in repo.files_at(commit).items():
                    s = {"rfilename": name, "size": repo.listed_size.get(name, len(data)), "blobId": git_blob_id(data)}
                    if repo.lfs(name):
                        s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
                    siblings.append(s)
                body = {"id": repo_id, "sha": commit, "private": False, "gated": repo.token is not None and "auto",
                        "siblings": siblings}
                self._send(200, {"Content-Type": "application/json"}, json.dumps(body).encode())

            def _resolve(self, repo_id: str, rev: str, name: str):
                found = self._repo_at(repo_id, rev)
                if found is None:
                    return
                repo, commit = found
                files = repo.files_at(commit)
                if name not in files:
                    self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit,
                                     "X-Error-Message": "Entry not found"}, b"Entry not found")
                    return
                data = files[name]
                key = (repo_id, name)
                if key in server.corrupt:
                    b = bytearray(data)
                    b[server.corrupt[key]] ^= 0x01
                    data = bytes(b)
                sha = hashlib.sha256(files[name]).hexdigest() if repo.lfs(name) else git_blob_id(files[name])
                h = {"X-Repo-Commit": commit, "ETag": f'"{sha}"', "Accept-Ranges": "bytes",
                     "Content-Type": "application/octet-stream"}
                if repo.lfs(name):
                    h["X-Linked-Etag"] = f'"{sha}"'
                    h["X-Linked-Size"] = len(data)
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                code = 206 if start else 200
                if start:
                    h["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                body = data[start:]
                self.send_response(code)
                for k, v in h.items():
                    self.send_header(k, str(v))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                drop = server.drop_once.pop(key, None) if self.command == "GET" else None
                sent = 0
                try:
                    while sent < len(body):
                        n = server.chunk if drop is None else min(server.chunk, max(drop - sent, 1))
                        self.wfile.write(body[sent:sent + n])
                        sent += n
                        if drop is not None and sent >= drop:
                            self.wfile.flush()
                            self.close_connection = True
                            self.connection.shutdown(2)
                            return
                        if server.chunk_delay:
                            time.sleep(server.chunk_delay)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    self.close_connection = True

        return H
