"""The /dev/shm sweep removes only what dead runs of ours left: our naming pattern, an arena header,
this user's regular file, and a supervisor pid that is dead. Real segments in the real /dev/shm."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coli.protocol.arena import Arena
from coli.stages.supervisor.sweep import describe, segment_name, sweep_dead_segments

SHM = Path("/dev/shm")


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def made():
    names = []
    yield names
    for n in names:
        Arena.unlink_name(n)


def test_sweeps_dead_runs_of_any_name_and_keeps_everything_else(made):
    dead, tag = dead_pid(), f"sw{os.getpid()}"
    gone = [segment_name(f"{tag}-a", dead, "experts"), segment_name(f"{tag}.b", dead, "residency")]
    live = segment_name(f"{tag}-live", os.getpid(), "experts")  # a live supervisor's
    for n in (*gone, live):
        made.append(n)
        Arena.create(n, 4096, 1).close()
    # our pattern and a dead pid, but not an arena (someone else's file that happens to match)
    foreign = segment_name(f"{tag}-foreign", dead, "experts")
    made.append(foreign)
    (SHM / foreign).write_bytes(b"not an arena")
    # an arena of a dead pid whose name is not the supervisor's pattern
    odd = f"coli-{tag}-{dead}-other"
    made.append(odd)
    Arena.create(odd, 4096, 1).close()

    removed = sweep_dead_segments()
    assert set(gone) <= set(removed)
    assert not any((SHM / n).exists() for n in gone)
    for kept in (live, foreign, odd):
        assert (SHM / kept).exists(), kept
    assert f"'{tag}-a'" in describe(gone) and f"'{tag}.b'" in describe(gone)
    assert not set(gone) & set(sweep_dead_segments())  # nothing of theirs is left to find
