"""`coli stats --json` without --once streams one JSON snapshot a line at --hz (it used to print nothing
until the run stopped), and the running request is counted as running, not queued."""

import json
import subprocess
import sys
import time

import pytest

from failures import long_stream
from oracles import load_oracle


@pytest.mark.timeout(120)
def test_stats_json_streams_lines_at_hz(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    c, it = long_stream(run, o)
    try:
        p = subprocess.Popen([sys.executable, "-m", "coli.cli.main", "stats", "--name", run.name, "--json", "--hz",
                              "5"], env=run.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        t0 = time.monotonic()
        try:
            while len(lines) < 6:
                assert time.monotonic() - t0 < 30, f"only {len(lines)} lines: {p.stderr.read() if p.poll() else ''}"
                lines.append(json.loads(p.stdout.readline()))
            took = time.monotonic() - t0
        finally:
            p.kill()
            p.wait(10)
        assert all("t" in snap for snap in lines)
        assert lines[-1]["t"] - lines[1]["t"] >= 4 * 0.2 * 0.9  # paced at --hz, not a burst
        sup = lines[-1]["supervisor"]
        assert sup["running"] == 1 and sup["queued"] == 0, sup  # the one request runs; none waits
        assert took < 20
    finally:
        it.close()
        c.close()
