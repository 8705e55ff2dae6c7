"""A real `coli serve` process beside a run, for the gateway tests (imported by conftest.py and the tests;
kept out of conftest.py so `from gateway_proc import ...` cannot pick up another folder's conftest)."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Run  # noqa: E402

_LISTEN = re.compile(r"listening on (http://\S+)")


class GatewayProc:
    def __init__(self, run: Run, *args: str, env: dict | None = None):
        self.log = run.run_base.parent / f"serve-{time.monotonic_ns()}.log"
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "coli.cli.main", "serve", "--name", run.name, "--http",
                                      "127.0.0.1:0", *args], env=env or run.env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = self._wait_url()
        u = urlparse(self.url)
        self.host, self.port = u.hostname, u.port

    def _wait_url(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTEN.search(self.log.read_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"coli serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"coli serve did not listen in {timeout} s:\n{self.log.read_text()}")

    def request(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None,
                timeout: float = 120.0) -> tuple[int, dict, bytes]:
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            c.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
            r = c.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            c.close()

    def post(self, path: str, body, **kw) -> tuple[int, dict]:
        status, _, data = self.request("POST", path, body, **kw)
        return status, json.loads(data)

    def metrics(self) -> dict[str, float]:
        _, _, data = self.request("GET", "/metrics")
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()
