"""`coli run` as a subprocess with `--json`, for the tests that check what a user of the CLI gets (CPU and GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def coli_run_json(model_dir, prompt: list[int], n: int, *args: str, timeout: float = 300,
                  env: dict | None = None) -> dict:
    """`coli run --json` on PROMPT (token ids) for N tokens, eos ignored, with ARGS (and ENV on top of this
    process's environment) -> its JSON (tokens, stats)."""
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "run", "--model", str(model_dir), "--prompt-ids",
                        ",".join(map(str, prompt)), "-n", str(n), "--ignore-eos", "--json", *args],
                       capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
