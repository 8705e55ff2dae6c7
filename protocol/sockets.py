"""ZeroMQ sockets configured the one way the runtime uses them, and send/recv through the codec.

Every socket has linger 0 (a dead peer never blocks shutdown), bounded high-water marks (backpressure is
arena slots, not socket buffers; queues only absorb jitter) and a maximum inbound frame size, so a peer
cannot make a stage allocate more than MAX_MESSAGE_BYTES per frame: libzmq drops the connection of a peer
that sends a bigger one. ROUTER sockets are "mandatory": sending to a peer that is gone raises
(zmq.ZMQError EHOSTUNREACH) instead of dropping the message silently.

`recv` always consumes a whole multipart message, so a bad one raises ProtocolError and the next call
reads the next message: the stage loop catches, logs and continues.
"""

from __future__ import annotations

from collections.abc import Iterable

import zmq

from .codec import MAX_MESSAGE_BYTES, decode, encode
from .errors import ProtocolError
from .messages import Message
from .rundir import check_ipc_path

DEFAULT_HWM = 1024  # messages per peer and direction; a token stream to a slow client stays bounded


def make_socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int = DEFAULT_HWM,
    identity: bytes | None = None,
    subscribe: Iterable[type[Message]] | None = None,
) -> zmq.Socket:
    """A `kind` socket (zmq.ROUTER, zmq.DEALER, zmq.PAIR, zmq.PUB, zmq.SUB, ...) bound or connected to
    `endpoint`. `identity` names a DEALER to the ROUTER it connects to. A SUB socket receives the message
    types in `subscribe` (frame 0 is the kind byte, so the filter is exact), or every type if None."""
    if endpoint.startswith("ipc://"):
        check_ipc_path(endpoint[len("ipc://") :])
    if hwm < 1:
        raise ValueError(f"hwm must be >= 1, got {hwm} (0 would mean unbounded queues)")
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        # libzmq drops a peer whose frame exceeds 4x the codec's limit (memory protection); anything
        # between reaches the codec, which refuses it with a ProtocolError the stage logs.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_MESSAGE_BYTES)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == zmq.SUB:
            if subscribe is None:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                for cls in subscribe:
                    sock.setsockopt(zmq.SUBSCRIBE, bytes([cls.KIND]))
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def send(sock: zmq.Socket, msg: Message, *, peer: bytes | None = None, flags: int = 0) -> None:
    """Send `msg`; on a ROUTER socket `peer` is the identity of the receiver. Raises ProtocolError if
    `msg` cannot be encoded, zmq.Again with zmq.NOBLOCK when the peer's queue is full."""
    frames = encode(msg)
    if peer is not None:
        frames.insert(0, peer)
    sock.send_multipart(frames, flags=flags, copy=True)


def recv(sock: zmq.Socket, *, flags: int = 0) -> Message:
    """The next message on a DEALER, PAIR, SUB or PULL socket; ProtocolError if it is malformed."""
    return decode(sock.recv_multipart(flags=flags))


def recv_from(sock: zmq.Socket, *, flags: int = 0) -> tuple[bytes, Message]:
    """(peer identity, message) from a ROUTER socket. A malformed message raises ProtocolError with
    `.peer` set, so the stage can log who sent it or answer with Error."""
    frames = sock.recv_multipart(flags=flags)
    peer = frames[0]
    try:
        return peer, decode(frames[1:])
    except ProtocolError as e:
        raise ProtocolError(f"from peer {peer!r}: {e}", peer=peer) from None
