"""`coli chat` as a person at a terminal meets it (issue 13 §3.4), against real stages on the demo model: the
real `coli chat` runs under a pseudo-terminal (python's pty, the chat's controlling terminal, so Ctrl-C is a
real SIGINT) and gets keystrokes: line editing and history, slash commands that never reach the model, empty
lines that do nothing, Ctrl-C that stops the answer (a cancelled request) and not the chat, and the KV cache
reused between turns without --session (prompt tokens split into reused + prefilled, from the executor)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "coli" / "demo" / "model"
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z~]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]|\x1b[=>]")
USAGE = re.compile(r"\[(\d+) prompt tokens: (\d+) reused, (\d+) prefilled; (\d+) generated")
QUESTION = "What does os.path.join do?"


class Terminal:
    """A process on a pseudo-terminal that is its controlling terminal; answers the cursor-position queries
    prompt_toolkit sends, as a terminal does."""

    def __init__(self, args: list[str], env: dict):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x28\x00\x78\x00\x00\x00\x00\x00")   # 40 rows x 120 columns

        def own_terminal():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # Ctrl-C as a shell on a terminal hands it over: a suite started as a background job of a
            # non-interactive shell inherits SIGINT ignored (POSIX), and would pass that on to the chat
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=own_terminal)
        os.close(slave)
        self.raw = b""
        self.seen = 0          # expect() searches what came after the previous match

    def _read(self, timeout: float) -> bool:
        r, _, _ = select.select([self.master], [], [], timeout)
        if not r:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:        # EIO: the process closed the terminal
            return False
        if not chunk:
            return False
        if b"\x1b[6n" in chunk:
            os.write(self.master, b"\x1b[1;1R")
        self.raw += chunk
        return True

    @property
    def text(self) -> str:
        return ANSI.sub(b"", self.raw).decode(errors="replace").replace("\r", "")

    def expect(self, pattern: str, timeout: float = 30.0) -> re.Match:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.text, self.seen)
            if m:
                self.seen = m.end()
                return m
            if time.monotonic() > deadline or not self._read(0.1):
                m = rx.search(self.text, self.seen)
                if m:
                    self.seen = m.end()
                    return m
                raise AssertionError(f"{pattern!r} did not appear; the terminal shows:\n{self.text[-3000:]}")

    def prompt(self) -> None:
        """Wait for the `you>` prompt, and for prompt_toolkit to have drawn it (it may draw it twice)."""
        self.expect(r"you>")
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            self._read(0.05)
        self.seen = len(self.text)

    def send(self, data: str | bytes) -> None:
        os.write(self.master, data.encode() if isinstance(data, str) else data)

    def usage(self, timeout: float = 60.0) -> tuple[int, int, int, int]:
        return tuple(int(g) for g in self.expect(USAGE.pattern, timeout).groups())

    def wait(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture(scope="module")
def run():
    """A real run (supervisor, reader, RAM tier, executor) on the demo model, stopped at the end."""
    if not (DEMO / "config.json").is_file():
        pytest.skip("demo model not built")
    base = Path(tempfile.mkdtemp(prefix="coli-chat-", dir="/tmp"))   # short: ipc paths have a length limit
    env = dict(os.environ, COLI_RUN_DIR=str(base / "r"), COLI_CACHE=str(base / "c"), XDG_STATE_HOME=str(base / "s"),
               TERM="xterm", COLUMNS="120", LINES="40")
    name = "chat"
    up = subprocess.run([sys.executable, "-m", "coli.cli.main", "up", "--name", name, "--detach", "--device", "cpu"],
                        env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stderr
    try:
        yield {"env": env, "name": name, "base": base}
    finally:
        subprocess.run([sys.executable, "-m", "coli.cli.main", "down", "--name", name], env=env, capture_output=True,
                       timeout=60)
        shutil.rmtree(base, ignore_errors=True)


def chat(run, *extra) -> Terminal:
    t = Terminal([sys.executable, "-m", "coli.cli.main", "chat", "--name", run["name"], *extra], run["env"])
    t.expect(r"/help for commands")
    t.prompt()
    return t


def prompt_len(*user_messages_and_answers: str) -> int:
    """Prompt tokens of a conversation, rendered and encoded by the same template and tokenizer the chat uses."""
    from coli.chat_template import load_chat_template
    from coli.tokenizer import load_tokenizer

    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(user_messages_and_answers)]
    return len(load_tokenizer(DEMO).encode(load_chat_template(DEMO).render(messages, add_generation_prompt=True)))


def log_events(run, stage: str, event: str) -> list[dict]:
    p = run["base"] / "r" / run["name"] / "logs" / f"{stage}.jsonl"
    out = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


@pytest.mark.timeout(180)
def test_lines_are_edited_kept_in_history_and_turns_reuse_the_kv_cache(run):
    t = chat(run)
    try:
        t.send("os.path.join do?")
        t.send("\x1b[H")                      # Home
        t.send("What does \r")
        t.expect(r"model> It returns")
        p1, r1, f1, g1 = t.usage()
        assert (p1, r1, f1) == (prompt_len(QUESTION), 0, prompt_len(QUESTION))   # the edited line was sent
        answer1 = t.text[t.text.rindex("model> ") + 7:].split("\n")[0].strip()
        t.prompt()
        t.send("What does os.path.split do?\r")
        p2, r2, f2, g2 = t.usage()
        assert p2 == prompt_len(QUESTION, answer1, "What does os.path.split do?")
        # without --session the chat's own session kept turn 1: only the new turn is prefilled
        assert r2 + f2 == p2 and r2 >= p1 and f2 < p2 - p1 + 2, (p1, g1, p2, r2, f2)
        t.prompt()
        t.send("\x1b[A")                      # Up: the last line back from the history
        t.send("\r")
        p3, r3, f3, _ = t.usage()
        assert p3 > p2 and r3 >= p2 and f3 < p3 - p2 + 2
        t.prompt()
        t.send("\x04")                        # Ctrl-D
        assert t.wait() == 0
        assert "^[[" not in t.text and "[1~" not in t.text
    finally:
        t.close()
    hist_file = run["base"] / "s" / "coli" / "chat_history"
    hist = hist_file.read_text()
    assert QUESTION in hist and "What does os.path.split do?" in hist
    assert hist_file.stat().st_mode & 0o777 == 0o600 and hist_file.parent.stat().st_mode & 0o777 == 0o700
    # the chat's session is dropped as the chat ends (memory only: it was never going to be saved)
    dropped = [e for e in log_events(run, "executor", "session_dropped") if e["session"].startswith("chat-")]
    assert dropped and dropped[-1]["found"] is True


@pytest.mark.timeout(180)
def test_slash_commands_and_empty_lines_never_reach_the_model(run):
    t = chat(run)
    try:
        t.send("\r")                           # an empty line: a new prompt, nothing sent, no exit
        t.prompt()
        t.send("/help\r")
        for cmd in ("/reset", "/session", "/stats", "/quit"):
            t.expect(re.escape(cmd))
        t.prompt()
        t.send("/nosuch\r")
        t.expect(r"unknown command /nosuch \(/help lists them")
        t.prompt()
        t.send("/session\r")
        t.expect(r"session chat-\d+-[0-9a-f]+ \(this chat's own: memory only, dropped when you quit\)")
        t.prompt()
        t.send(QUESTION + "\r")
        p1, r1, _, _ = t.usage()
        assert p1 == prompt_len(QUESTION) and r1 == 0      # none of the lines above joined the conversation
        t.prompt()
        t.send("/stats\r")
        t.expect(rf"turn 1: {p1} prompt tokens = 0 reused \+ {p1} prefilled")
        t.prompt()
        t.send("/reset\r")
        t.expect(r"conversation forgotten")
        t.prompt()
        t.send(QUESTION + "\r")
        p2, r2, f2, _ = t.usage()
        assert p2 == p1 and r2 == p1 - 1 and f2 == 1       # the same prompt again: all but one token cached
        t.prompt()
        t.send("\x03")                         # one Ctrl-C at the prompt: a hint, the chat goes on
        t.expect(r"Ctrl-C again or Ctrl-D to quit")
        assert t.proc.poll() is None
        t.send("/quit\r")
        assert t.wait() == 0
    finally:
        t.close()


@pytest.mark.timeout(240)
def test_ctrl_c_stops_the_answer_and_a_second_at_the_prompt_quits(run):
    before = len([e for e in log_events(run, "supervisor", "request_done") if e.get("finish") == "cancelled"])
    t = chat(run, "--ignore-eos", "--max-tokens", "3000")
    try:
        t.send("Tell me a long story\r")
        t.expect(r"model> ")
        t.expect(r"\w+ \w+ \w+", timeout=60)   # it is answering
        t.send("\x03")
        t.expect(r"\[stopped\]")
        p1, _, _, g1 = t.usage()
        assert 0 < g1 < 3000
        t.prompt()
        assert t.proc.poll() is None           # the chat is still here
        t.send(QUESTION + "\r")
        t.expect(r"model> ")
        t.expect(r"\w+ \w+", timeout=60)
        t.send("\x03")
        t.expect(r"\[stopped\]")
        p2, r2, f2, _ = t.usage()
        assert r2 > p1 and r2 + f2 == p2       # the stopped answer's tokens stayed in the session
        t.prompt()
        t.send("\x03")                         # right after a stopped answer: Ctrl-C at the prompt quits
        assert t.wait() == 0
    finally:
        t.close()
    time.sleep(0.5)
    cancelled = [e for e in log_events(run, "supervisor", "request_done") if e.get("finish") == "cancelled"]
    assert len(cancelled) - before == 2        # both answers were cancelled requests, not a dead chat


@pytest.mark.timeout(120)
def test_piped_lines_work_and_an_empty_line_does_not_quit(run):
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "chat", "--name", run["name"]],
                       input=f"{QUESTION}\n\n/stats\n", env=run["env"], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert "It returns" in r.stdout
    assert f"turn 1: {prompt_len(QUESTION)} prompt tokens" in r.stderr     # /stats ran after the empty line


@pytest.mark.timeout(120)
def test_a_refused_turn_costs_that_turn_not_the_chat(run):
    # 6,000 words cannot fit the demo model's 4,096-position context: refused at the edge, and the chat goes on
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "chat", "--name", run["name"]],
                       input="word " * 6000 + f"\n{QUESTION}\n/stats\n", env=run["env"], capture_output=True,
                       text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert "error: " in r.stderr and "context" in r.stderr and "/reset starts the conversation over" in r.stderr
    assert "It returns" in r.stdout
    assert f"turn 1: {prompt_len(QUESTION)} prompt tokens = 0 reused" in r.stderr   # the refused line was not kept
