"""Durable private writes and the sweep of temp files that killed writers left (sessions, usage counts)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from coli.stages.ramtier.process import USAGE_FILE, load_usage, save_usage
from coli.stages.tmpfiles import write_private


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_write_private_is_0600_whatever_the_umask_and_a_failed_write_leaves_nothing(tmp_path):
    old = os.umask(0)
    try:
        write_private(tmp_path / "f", lambda t: t.write_bytes(b"secret"), prefix=".f.tmp")
    finally:
        os.umask(old)
    assert (tmp_path / "f").read_bytes() == b"secret" and ((tmp_path / "f").stat().st_mode & 0o777) == 0o600

    def boom(t):
        t.write_bytes(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space"):
        write_private(tmp_path / "f", boom, prefix=".f.tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"] and (tmp_path / "f").read_bytes() == b"secret"


def test_usage_temp_of_a_killed_ram_tier_is_swept_from_the_container_dir(tmp_path):
    left = tmp_path / f"coli-usage.tmp{_dead_pid()}"
    left.write_text('{"version": 1, "counts": [1, 2')    # what a RAM tier killed mid-save leaves
    save_usage(tmp_path, np.arange(4, dtype=np.int64))
    assert load_usage(tmp_path, 4).tolist() == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [USAGE_FILE]
