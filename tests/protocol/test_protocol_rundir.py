"""The run directory: private (0700, ours), short enough for Unix sockets, stale runs recognised."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from coli.protocol import rundir as rd
from coli.protocol.errors import RunDirError
from coli.protocol.rundir import RunDir

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def base():
    # pytest's tmp_path can be too long for sun_path; a short private base under /tmp is not
    path = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def mode_of(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_created_private_with_its_layout(base):
    old = os.umask(0o022)
    try:
        run = RunDir("r1", base=base)
    finally:
        os.umask(old)
    assert run.path == base / "r1" and run.path.is_dir()
    assert mode_of(run.path) == 0o700 and mode_of(run.logs_dir) == 0o700
    assert os.lstat(run.path).st_uid == os.getuid()
    assert run.endpoint("reader") == f"ipc://{base}/r1/reader.sock"
    assert run.log_path("reader") == base / "r1" / "logs" / "reader.jsonl"
    assert run.pid_file.parent == run.path and run.state_file.parent == run.path
    assert RunDir("r1", base=base).path == run.path  # reopening our own private dir is fine


def test_refuses_a_run_dir_others_could_reach(base):
    (base / "open").mkdir(mode=0o755)
    os.chmod(base / "open", 0o755)
    with pytest.raises(RunDirError, match=r"run dir .*open has mode 0755, not 0700"):
        RunDir("open", base=base)
    (base / "real").mkdir(mode=0o700)
    (base / "link").symlink_to(base / "real")
    with pytest.raises(RunDirError, match="is not a directory"):
        RunDir("link", base=base)


def test_refuses_a_base_others_can_rename_in(base):
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(RunDirError, match="writable by others without the sticky bit"):
        RunDir("r", base=shared)
    os.chmod(shared, 0o1777)  # like /tmp: entries can only be renamed by their owner
    assert mode_of(RunDir("r", base=shared).path) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another uid")
def test_refuses_a_run_dir_owned_by_someone_else(base):
    (base / "theirs").mkdir(mode=0o700)
    os.chown(base / "theirs", 12345, 12345)
    with pytest.raises(RunDirError, match="belongs to uid 12345"):
        RunDir("theirs", base=base)


def test_socket_paths_must_fit_sun_path(base):
    deep = base / ("d" * 80)
    with pytest.raises(RunDirError, match=r"too long for Unix socket paths .* set COLI_RUN_DIR"):
        RunDir("run", base=deep)
    assert not deep.exists()  # refused before creating anything
    with pytest.raises(RunDirError, match=r"ipc socket path .* over the 107-byte limit .* COLI_RUN_DIR"):
        rd.check_ipc_path("/tmp/" + "s" * 120)
    run = RunDir("run", base=base)
    with pytest.raises(RunDirError, match="stage name"):
        run.endpoint("../escape")
    with pytest.raises(RunDirError, match="stage name"):
        run.endpoint("x" * (rd.MAX_STAGE_CHARS + 1))
    assert len(run.endpoint("x" * rd.MAX_STAGE_CHARS)) - len("ipc://") <= rd.SUN_PATH_MAX


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "x" * 65, "-dash"])
def test_bad_run_names(base, bad):
    with pytest.raises(RunDirError, match="run name"):
        RunDir(bad, base=base)


def test_default_base_follows_the_environment(monkeypatch):
    monkeypatch.setenv("COLI_RUN_DIR", "/x/runs")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert rd.default_base() == Path("/x/runs")
    monkeypatch.delenv("COLI_RUN_DIR")
    assert rd.default_base() == Path("/run/user/7/coli")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert rd.default_base() == Path(tempfile.gettempdir()) / f"coli-{os.getuid()}"


def test_env_base_is_created_private(base, monkeypatch):
    monkeypatch.setenv("COLI_RUN_DIR", str(base / "runs"))
    run = RunDir("r")
    assert run.path == base / "runs" / "r"
    assert mode_of(base / "runs") == 0o700


def test_open_without_create(base):
    with pytest.raises(RunDirError, match="no run named 'ghost'"):
        RunDir("ghost", base=base, create=False)
    RunDir("here", base=base)
    assert RunDir("here", base=base, create=False).path == base / "here"


def test_pid_file_and_stale_detection(base):
    run = RunDir("r", base=base)
    assert run.read_pid() is None
    assert not run.is_stale() and not run.is_live()  # no pid file yet: starting, not stale
    run.write_pid()
    pid, start = run.read_pid()
    assert pid == os.getpid() and start is not None
    assert run.is_live() and not run.is_stale()
    run.write_pid(dead_pid())
    assert run.is_stale() and not run.is_live()
    # our pid with another start time: the recorded process is gone and the pid was reused
    run.pid_file.write_text(f"{os.getpid()} {start - 1}\n")
    assert run.is_stale()
    run.pid_file.write_text("garbage")
    with pytest.raises(RunDirError, match="pid file .* is damaged"):
        run.is_stale()


def test_state_round_trip(base):
    run = RunDir("r", base=base)
    assert run.read_state() is None
    state = {"model": "/models/glm5", "budgets": {"ram_gib": 64, "vram_gib": 16}, "pids": {"reader": 12}}
    run.write_state(state)
    assert run.read_state() == state
    assert not list(run.path.glob(".*.tmp"))  # the atomic write left no temp file
    run.state_file.write_text("{half")
    with pytest.raises(RunDirError, match="state file .* is damaged"):
        run.read_state()


def test_cleanup(base):
    run = RunDir("r", base=base)
    run.write_pid()
    run.log_path("reader").write_text("{}\n")
    (run.path / "reader.sock").touch()
    run.cleanup(keep_logs=True)  # our own pid: allowed
    assert sorted(p.name for p in run.path.iterdir()) == ["logs"]
    assert run.log_path("reader").exists()
    run.cleanup()
    assert not run.path.exists()


def test_cleanup_refused_while_another_process_holds_the_run(base):
    run = RunDir("r", base=base)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run.write_pid(holder.pid)
        with pytest.raises(RunDirError, match=rf"run 'r' is live \(pid {holder.pid}\)"):
            run.cleanup()
    finally:
        holder.kill()
        holder.wait()
    assert run.is_stale()
    run.cleanup()
    assert not run.path.exists()


def test_the_claim_is_exclusive_dies_with_its_holder_and_survives_cleanup(base):
    import signal
    import textwrap

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from coli.protocol.rundir import RunDir
        rd = RunDir("c1", base={str(base)!r})
        rd.claim()
        rd.write_pid()
        print("claimed", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        mine = RunDir("c1", base=base)
        with pytest.raises(rd.RunClaimed, match=r"run 'c1' is already up or starting \(supervisor pid \d+\)") as e:
            mine.claim()
        assert e.value.pid == holder.pid
        holder.send_signal(signal.SIGKILL)  # the kernel drops the lock with its holder, however it dies
        holder.wait(10)
        mine.claim()
        assert mine.claimed
        assert mine.is_stale()
        mine.cleanup(keep_logs=True)  # the lock file stays: another process may lock only this one inode
        assert mine.lock_file.exists()
        other = RunDir("c1", base=base)
        with pytest.raises(rd.RunClaimed, match=r"another `coli up` or `coli down` is on it"):
            other.claim()  # held, no pid file yet: starting
        mine.release()
        other.claim()
        other.release()
    finally:
        holder.kill()
        holder.wait(10)
