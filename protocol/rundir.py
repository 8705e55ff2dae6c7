"""The run directory: one private directory per run holding its ipc:// sockets, logs, pid file and state.

    <base>/<name>/              mode 0700, owned by this user (refused otherwise: the sockets in it
        <stage>.sock            accept control messages from anyone who can reach them)
        logs/<stage>.jsonl
        coli.pid                "<pid> <start time>" of the supervisor
        claim.lock              flock'ed by the supervisor for its whole life: the one atomic "this run is
                                mine" (kept across runs; the kernel drops the lock when its holder dies)
        state.json              the run: model, budgets, stage pids, arena names (the supervisor's)

<base> is $COLI_RUN_DIR, else $XDG_RUNTIME_DIR/coli, else /tmp/coli-<uid>.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from .errors import RunDirError

SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL
MAX_STAGE_CHARS = 24  # budgeted into the path-length check done when the run dir is opened
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_STAGE = re.compile(rf"[a-z0-9][a-z0-9_-]{{0,{MAX_STAGE_CHARS - 1}}}")


def default_base() -> Path:
    if os.environ.get("COLI_RUN_DIR"):
        return Path(os.environ["COLI_RUN_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "coli"
    return Path(tempfile.gettempdir()) / f"coli-{os.getuid()}"


def _process_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), None if unknown.
    With the pid it identifies a process across pid reuse."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) is in parentheses and may contain spaces or ')': split after the last ')'
    return int(raw[raw.rindex(b")") + 2 :].split()[19])


def _zombie(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return raw[raw.rindex(b")") + 2 :][:1] == b"Z"


def process_stopped(pid: int) -> bool:
    """True if `pid` is stopped (SIGSTOP, Ctrl-Z: state T; a debugger: t): alive, but answers nothing."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return raw[raw.rindex(b")") + 2 :][:1] in (b"T", b"t")


def _alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else: alive, but maybe a reused pid
    if _zombie(pid):
        return False  # dead, only not reaped yet by its parent (a shell, a test harness)
    if start is not None:
        now = _process_start(pid)
        if now is not None and now != start:
            return False  # the pid was reused by another process
    return True


def _write_atomic(path: Path, text: str) -> None:
    # readers (coli stats, a second `coli up`) must never see half a file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunClaimed(RunDirError):
    """Another live process holds the run (it is up, starting, or being cleaned up)."""

    def __init__(self, message: str, pid: int | None):
        super().__init__(message)
        self.pid = pid


class RunDir:
    """The run directory of run `name`, created (mode 0700) unless `create` is False."""

    def __init__(self, name: str, base: str | os.PathLike[str] | None = None, *, create: bool = True) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
            raise RunDirError(f"run name {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -")
        self.name = name
        self.base = Path(base) if base is not None else default_base()
        self.path = self.base.absolute() / name
        # fail at `coli up`, not when the last stage binds: the longest stage socket must fit sun_path
        longest = len(os.fsencode(self.path)) + len(f"/{'x' * MAX_STAGE_CHARS}.sock")
        if longest > SUN_PATH_MAX:
            raise RunDirError(
                f"run dir {str(self.path)!r} is too long for Unix socket paths ({longest} > {SUN_PATH_MAX} bytes "
                f"with a {MAX_STAGE_CHARS}-character stage name): set COLI_RUN_DIR to a shorter directory"
            )
        if create:
            self._make()
        elif not self.path.exists():
            raise RunDirError(f"no run named {name!r} (no directory {self.path})")
        self._check_private(self.path)

    def _make(self) -> None:
        if not self.base.exists():
            self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        # whoever can rename entries in the base could swap our run dir for theirs after we check it:
        # the base must be ours (or root's, like /tmp) and, if others may write to it, sticky
        st = self.base.stat()
        if st.st_uid not in (os.getuid(), 0):
            raise RunDirError(
                f"run base {self.base} belongs to uid {st.st_uid}: set "
                f"COLI_RUN_DIR to a directory you own"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise RunDirError(
                f"run base {self.base} is writable by others without the sticky "
                f"bit: set COLI_RUN_DIR to a directory only you can write"
            )
        try:
            self.path.mkdir(mode=0o700)
            os.chmod(self.path, 0o700)  # mkdir's mode is filtered by the umask; we created it, so this is safe
        except FileExistsError:
            pass  # reusing a run dir is fine if it is ours and private; _check_private decides
        logs = self.path / "logs"
        if not logs.is_symlink():
            logs.mkdir(mode=0o700, exist_ok=True)

    def _check_private(self, path: Path) -> None:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise RunDirError(
                f"run dir {path} is not a directory (a symlink or a "
                f"file): remove it or pick another run name"
            )
        if st.st_uid != os.getuid():
            raise RunDirError(
                f"run dir {path} belongs to uid {st.st_uid}, not to this "
                f"user ({os.getuid()}): refusing to use it"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode != 0o700:
            raise RunDirError(
                f"run dir {path} has mode {mode:04o}, not 0700: its sockets would be "
                f"reachable by others (chmod 700 it or remove it)"
            )

    # -- paths ----------------------------------------------------------------------------------------

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def pid_file(self) -> Path:
        return self.path / "coli.pid"

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def lock_file(self) -> Path:
        return self.path / "claim.lock"

    # -- the claim --------------------------------------------------------------------------------------

    def claim(self) -> None:
        """Make this process the run's only owner, atomically: an exclusive flock on claim.lock, held
        until release() or this process dies (the kernel drops it even on SIGKILL). Two `coli up` of one
        name started at the same instant both see "no pid file" with a check-then-write; only one of them
        gets the lock. Raises RunClaimed, naming the holder's pid where its pid file is already written."""
        if getattr(self, "_claim_fd", None) is not None:
            return
        while True:
            fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                rec = self._read_pid_quietly()
                pid = rec[0] if rec is not None and _alive(*rec) else None
                who = f"supervisor pid {pid}" if pid is not None else "another `coli up` or `coli down` is on it"
                raise RunClaimed(f"run {self.name!r} is already up or starting ({who}): stop it with "
                                 f"`coli down --name {self.name}` or pick another --name", pid) from None
            # the file we locked must still be the one at the path (a cleanup may have removed it between
            # our open and our lock, and a third process would then lock a fresh file): else try again
            try:
                same = os.stat(self.lock_file, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._claim_fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        """Give the claim back (the end of a clean stop)."""
        fd, self._claim_fd = getattr(self, "_claim_fd", None), None
        if fd is not None:
            os.close(fd)

    @property
    def claimed(self) -> bool:
        """True while this process holds the claim."""
        return getattr(self, "_claim_fd", None) is not None

    def _read_pid_quietly(self) -> tuple[int, int | None] | None:
        try:
            return self.read_pid()
        except RunDirError:
            return None

    def _stage(self, stage: str) -> str:
        if not isinstance(stage, str) or not _STAGE.fullmatch(stage):
            raise RunDirError(f"stage name {stage!r} must be 1-{MAX_STAGE_CHARS} characters of a-z 0-9 _ -")
        return stage

    def socket_path(self, stage: str) -> Path:
        return self.path / f"{self._stage(stage)}.sock"

    def endpoint(self, stage: str) -> str:
        """`ipc://<run dir>/<stage>.sock`, the address `stage` binds."""
        path = self.socket_path(stage)
        check_ipc_path(str(path))
        return f"ipc://{path}"

    def log_path(self, stage: str) -> Path:
        return self.logs_dir / f"{self._stage(stage)}.jsonl"

    # -- pid and state --------------------------------------------------------------------------------

    def write_pid(self, pid: int | None = None) -> None:
        """Record the run's supervisor (this process by default) with its start time, so a pid reused
        after a crash does not make a dead run look alive."""
        pid = os.getpid() if pid is None else pid
        start = _process_start(pid)
        _write_atomic(self.pid_file, f"{pid} {start if start is not None else '-'}\n")

    def read_pid(self) -> tuple[int, int | None] | None:
        """(pid, start time or None) from the pid file; None if there is none. Raises on a damaged one."""
        try:
            text = self.pid_file.read_text()
        except FileNotFoundError:
            return None
        parts = text.split()
        try:
            pid = int(parts[0])
            start = None if len(parts) < 2 or parts[1] == "-" else int(parts[1])
        except (IndexError, ValueError):
            raise RunDirError(f"pid file {self.pid_file} is damaged ({text[:40]!r}): remove it") from None
        return pid, start

    def write_state(self, state: dict[str, Any]) -> None:
        _write_atomic(self.state_file, json.dumps(state, indent=2, sort_keys=True) + "\n")

    def read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise RunDirError(f"state file {self.state_file} is damaged ({e}): remove it") from None

    def is_live(self) -> bool:
        """True if the pid file names a running process (the same one that wrote it)."""
        rec = self.read_pid()
        return rec is not None and _alive(*rec)

    def is_stale(self) -> bool:
        """True if the pid file names a process that is gone: the run died without cleaning up. A run
        dir with no pid file is not called stale (a run may be starting and not have written it yet)."""
        rec = self.read_pid()
        return rec is not None and not _alive(*rec)

    def cleanup(self, *, keep_logs: bool = False) -> None:
        """Remove the run dir (sockets, pid, state; logs too unless `keep_logs`). Refused while another
        live process holds the run. Shared-memory arenas are the supervisor's to unlink, listed in state."""
        rec = self.read_pid()
        if rec is not None and rec[0] != os.getpid() and _alive(*rec):
            raise RunDirError(f"run {self.name!r} is live (pid {rec[0]}): stop it before cleaning up {self.path}")
        if not keep_logs:
            shutil.rmtree(self.path, ignore_errors=False)
            return
        for entry in self.path.iterdir():
            if entry.name == "logs" and entry.is_dir() and not entry.is_symlink():
                continue
            if entry.name == self.lock_file.name:
                continue  # removing a lock file someone may hold would let a third process lock a new one
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def check_ipc_path(path: str) -> None:
    """Refuse a Unix socket path longer than sun_path holds (libzmq would fail with a bare EINVAL)."""
    n = len(os.fsencode(path))
    if n > SUN_PATH_MAX:
        raise RunDirError(
            f"ipc socket path {path!r} is {n} bytes, over the {SUN_PATH_MAX}-byte limit of a Unix socket "
            f"path: set COLI_RUN_DIR to a shorter directory"
        )
