"""One writer per directory (coli/container/dir_lock.py): while another process holds DST, `coli convert`
fails at once with a one-line error naming DST and writes nothing there; once that process dies (the kernel
drops its flock, SIGKILL included) the same convert succeeds."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from coli.container.dir_lock import sole_writer
from coli.container.format import MANIFEST_NAME, ContainerError
from coli.container.writer import ConvertOptions, convert
from coli.hub.client import HubError

# a real second process that takes the same lock the writers take, says so, and waits to be killed
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def held(tmp_path):
    """A directory another live process holds, as a running `coli convert` or `coli pull` would."""
    d = tmp_path / "dst"
    d.mkdir()
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield d, p
    finally:
        p.kill()
        p.wait(timeout=10)


def test_convert_into_a_directory_another_process_writes_fails_and_writes_nothing(small_fp8, held):
    d, holder = held
    busy = f"^{re.escape(str(d))}: another coli convert is writing this directory$"
    with pytest.raises(ContainerError, match=busy):
        convert(small_fp8, d, ConvertOptions())
    assert list(d.iterdir()) == []
    holder.kill()            # SIGKILL: nothing of the holder's runs, the kernel drops the lock
    holder.wait(timeout=10)
    convert(small_fp8, d, ConvertOptions())
    assert (d / MANIFEST_NAME).is_file()


def test_the_lock_names_the_command_and_raises_its_error(held):
    d, _ = held
    with pytest.raises(HubError, match=f"^{re.escape(str(d))}: another coli pull is writing this directory$"):
        with sole_writer(d, "coli pull", HubError):
            pytest.fail("the block ran while another process held the directory")


def test_the_lock_is_free_again_after_the_block(tmp_path):
    with sole_writer(tmp_path, "coli convert", ContainerError):
        pass
    with sole_writer(tmp_path, "coli convert", ContainerError):
        pass
