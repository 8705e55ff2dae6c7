"""CLI checks of the run-lifecycle commands that need no run: bad values are refused in one line naming
the option and the valid choices, before anything starts."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def coli(*args, base):
    env = dict(os.environ, COLI_RUN_DIR=str(base))
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=50)


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="cl-", dir="/tmp"))
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("hz", ["0", "-1", "1000"])
def test_stats_refuses_a_rate_out_of_range(base, hz):
    r = coli("stats", "--name", "x", "--hz", hz, base=base)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--hz" in r.stderr and "(0, 50]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_up_refuses_an_unknown_log_level(base):
    r = coli("up", "--name", "x", "--log-level", "loud", base=base)
    assert r.returncode == 2
    assert "--log-level 'loud'" in r.stderr and "debug, info, warning, error" in r.stderr, r.stderr
    assert not (base / "x").exists()  # refused before any run dir, process or segment


def test_ps_with_no_runs(base):
    r = coli("ps", base=base)
    assert r.returncode == 0 and "no runs" in r.stdout
    assert coli("ps", "--json", base=base).stdout.strip() == "[]"
