"""The interactive `coli chat`: line editing and history (prompt_toolkit), slash commands, Ctrl-C that stops the
answer instead of the chat, and one session per chat so each turn prefills only its new tokens.

The pure part (`parse_line`, `Conversation`) has no terminal and no sockets; `repl` wires it to a terminal and
a Client. Without `--session` the chat makes an *ephemeral* session (memory only, never saved, dropped when the
chat ends): the executor keeps the conversation's KV cache between turns, so turn N prefills only what turn N
added, as `--session NAME` does for a conversation that outlives the chat."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from coli.serve.client import RequestError

HELP = {
    "/help": "this list",
    "/reset": "forget the conversation (the system message stays)",
    "/session": "which session holds the conversation's KV cache, and how much of it",
    "/stats": "tokens per turn: prompt, reused from the cache, prefilled, generated",
    "/quit": "leave (also /exit, Ctrl-D, or Ctrl-C twice at the prompt)",
}
ALIASES = {"/exit": "/quit", "/q": "/quit", "/?": "/help"}


def parse_line(line: str) -> tuple[str, str]:
    """A typed line as ("empty", "") | ("command", "/name") | ("message", text). "//text" sends "/text"."""
    s = line.strip()
    if not s:
        return "empty", ""
    if s.startswith("//"):
        return "message", s[1:]
    if s.startswith("/"):
        name = s.split()[0].lower()
        return "command", ALIASES.get(name, name)
    return "message", line


def history_path() -> Path:
    """Where the chat's line history lives: $XDG_STATE_HOME/coli/chat_history (~/.local/state by default)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "coli" / "chat_history"


@dataclass
class Turn:
    prompt_tokens: int
    reused_tokens: int
    prefill_tokens: int
    generated: int
    finish: str
    decode_tps: float


@dataclass
class Conversation:
    """The messages so far and the session that caches them."""

    system: str | None
    session: str
    ephemeral: bool                       # this chat's own session: memory only, dropped at exit
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    @staticmethod
    def for_chat(system: str | None, session: str | None) -> "Conversation":
        if session is not None:
            return Conversation(system, session, ephemeral=False)
        return Conversation(system, f"chat-{os.getpid()}-{uuid.uuid4().hex[:8]}", ephemeral=True)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def request_options(self) -> dict:
        return {"session": self.session, "new_session": True, "ephemeral": self.ephemeral}

    def describe_session(self) -> str:
        kind = ("this chat's own: memory only, dropped when you quit" if self.ephemeral
                else "kept between turns and across coli down / coli up")
        last = self.turns[-1] if self.turns else None
        held = (f"; after turn {len(self.turns)} it caches up to {last.prompt_tokens + last.generated} tokens "
                f"(that turn's prompt and answer)" if last else "; empty until the first answer")
        return f"session {self.session} ({kind}){held}"

    def describe_turns(self) -> str:
        if not self.turns:
            return "no turns yet"
        lines = [f"turn {i}: {t.prompt_tokens} prompt tokens = {t.reused_tokens} reused + {t.prefill_tokens} "
                 f"prefilled; {t.generated} generated ({t.finish})" for i, t in enumerate(self.turns, 1)]
        p, r = sum(t.prompt_tokens for t in self.turns), sum(t.reused_tokens for t in self.turns)
        lines.append(f"all turns: {p} prompt tokens, {r} reused from the cache ({100 * r / max(p, 1):.0f}%)")
        return "\n".join(lines)


def usage_line(t: Turn) -> str:
    return (f"[{t.prompt_tokens} prompt tokens: {t.reused_tokens} reused, {t.prefill_tokens} prefilled; "
            f"{t.generated} generated" + (f", {t.decode_tps:.1f} tok/s" if t.decode_tps else "")
            + ("; stopped" if t.finish == "cancelled" else "") + "]")


# ---- the terminal -------------------------------------------------------------------------------------------
class LineReader:
    """prompt_toolkit on a terminal (editing, history kept in history_path()); plain lines from a pipe."""

    def __init__(self, prompt: str = "you> "):
        self.prompt = prompt
        self.session = None
        if sys.stdin.isatty() and sys.stdout.isatty():
            try:
                from prompt_toolkit import PromptSession
                from prompt_toolkit.history import FileHistory
            except ImportError:     # an install from before it was a dependency: plain lines still work
                say("(no line editing: prompt_toolkit is not installed; pip install -e . brings it)")
                return

            p = history_path()
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # the history is the user's side of every conversation: private, as the session files are
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
            os.chmod(p, 0o600)
            self.session = PromptSession(history=FileHistory(str(p)))

    def read(self) -> str:
        """A line; raises EOFError (Ctrl-D / end of input) or KeyboardInterrupt (Ctrl-C)."""
        if self.session is not None:
            return self.session.prompt(self.prompt)
        return input(self.prompt)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def repl(client, tok, template, system: str | None, session: str | None, max_tokens: int, kw: dict,
         encode, stream_answer) -> None:
    """Read, send, stream, until /quit, Ctrl-D or a second Ctrl-C at the prompt. `encode(messages)` gives the
    prompt ids; `stream_answer(ids, extra_kw)` prints the answer and returns (tokens, Done or None)."""
    conv = Conversation.for_chat(system, session)
    eos = set(client.info.get("eos_token_ids") or [])
    reader = LineReader()
    say(f"chatting with {client.info.get('model')}: /help for commands, Ctrl-C stops an answer, Ctrl-D quits")
    armed = False     # a Ctrl-C came last: one more at the prompt quits
    try:
        while True:
            try:
                line = reader.read()
            except EOFError:
                say("")
                return
            except KeyboardInterrupt:
                if armed:
                    return
                armed = True
                say("(Ctrl-C again or Ctrl-D to quit)")
                continue
            armed = False
            what, text = parse_line(line)
            if what == "empty":
                continue
            if what == "command":
                if _command(text, conv):
                    return
                continue
            conv.messages.append({"role": "user", "content": text})
            ids = encode(conv.messages)
            sys.stdout.write("model> ")
            sys.stdout.flush()
            try:
                out, done, stopped = stream_answer(ids, conv.request_options())
            except RequestError as e:     # this turn is refused (e.g. longer than the context): the chat goes on
                sys.stdout.write("\n")
                conv.messages.pop()
                say(f"error: {e} (the message was not added; /reset starts the conversation over)")
                continue
            armed = stopped
            answer = tok.decode([t for t in out if t not in eos], skip_special_tokens=True)
            conv.messages.append({"role": "assistant", "content": answer})
            timing = dict(done.timing) if done is not None else {}
            t = Turn(len(ids), int(timing.get("reused_tokens", 0)), int(timing.get("prefill_tokens", len(ids))),
                     len(out), "cancelled" if stopped else (done.finish_reason if done else "?"),
                     float(timing.get("decode_tokens_per_s", 0.0)))
            conv.turns.append(t)
            say(usage_line(t))
    finally:
        if conv.ephemeral:
            client.drop_session(conv.session)


def _command(name: str, conv: Conversation) -> bool:
    """Run a slash command; True means quit."""
    if name == "/quit":
        return True
    if name == "/help":
        say("\n".join(f"  {k:<9} {v}" for k, v in HELP.items()) + "\n  //text    send a message that starts with /")
    elif name == "/reset":
        conv.reset()
        say("(conversation forgotten)")
    elif name == "/session":
        say(conv.describe_session())
    elif name == "/stats":
        say(conv.describe_turns())
    else:
        say(f"unknown command {name} (/help lists them; //text sends a message starting with /)")
    return False
