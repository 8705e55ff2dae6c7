"""The HELLO half of the HELLO -> READY handshake: what a peer says first, and the version check."""

from __future__ import annotations

import os

from .errors import ProtocolError
from .messages import PROTOCOL_VERSION, Hello, Message


def make_hello(stage: str) -> Hello:
    """The Hello this process sends first on connecting, as `stage` ("reader", "client", ...)."""
    return Hello(stage=stage, pid=os.getpid(), protocol_version=PROTOCOL_VERSION)


def check_hello(msg: Message, *, stage: str | None = None) -> Hello:
    """`msg` as a Hello speaking this protocol version (and from `stage`, if given), else ProtocolError.

    A version mismatch means two installs of ColiStream are mixed (a stale process from an upgrade, a
    client from another venv); the message says which side speaks what."""
    if not isinstance(msg, Hello):
        raise ProtocolError(f"expected Hello as the first message, got {type(msg).__name__}")
    if msg.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{msg.stage!r} (pid {msg.pid}) speaks protocol version {msg.protocol_version}, this process "
            f"speaks {PROTOCOL_VERSION}: mixed ColiStream installs (restart every process from one install)"
        )
    if stage is not None and msg.stage != stage:
        raise ProtocolError(f"expected Hello from stage {stage!r}, got one from {msg.stage!r} (pid {msg.pid})")
    return msg


def run_identity(stage: str, control: bytes | None) -> bytes:
    """The routing identity `stage` uses on the other stages' sockets: its name plus the run's secret (the
    supervisor's identity `supervisor-<secret>`, handed to every stage at spawn), so a stage can tell the
    run's own peers from any other process of the same user. Without a secret: the plain name."""
    if not control:
        return stage.encode()
    return stage.encode() + b"-" + control.split(b"-", 1)[-1]
