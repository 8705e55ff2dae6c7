"""Every message the ColiStream processes exchange, and nothing else.

Each message is a frozen dataclass with a class-level `KIND` byte that goes into frame 0 on the wire
(see `codec.py`). Fields are primitives only — int, float, str, bool, None, lists and str-keyed dicts of
those, plus `SlotRef` records nested in `ExpertReady` — so msgpack encodes them without hooks and the
codec can check every field against its annotation. `__post_init__` checks the invariants a type cannot
express (non-negative indices, probabilities in range) so a well-typed but nonsensical message is
refused on both sides of the socket; a negative slot index, for example, would otherwise wrap around in
Python indexing and read the wrong expert.

Kind bytes, grouped by who talks to whom (0x00 is never a valid kind, so an all-zero frame is refused):

    0x01-0x0F  control: supervisor <-> stages and clients
    0x10-0x1F  generation: client <-> supervisor <-> executor
    0x20-0x2F  expert residency: executor <-> RAM tier (bulk bytes stay in the arena; SlotRef points there)
    0x30-0x3F  NVMe reads: RAM tier <-> reader

Request ids: client-facing requests carry a `str` id (clients mint them, OpenAI ids are strings);
internal data-plane requests carry an `int` id (a per-stage counter; there are 75 per decoded token).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

# Bump on any change to a message's fields or meaning; checked in the HELLO handshake (handshake.py).
PROTOCOL_VERSION = 1

_U64 = 1 << 64  # msgpack carries unsigned ints up to 2**64 - 1 (xxhash64 checksums, seeds)
MAX_ID_CHARS = 128  # request ids, stage and session names: long enough for a uuid4 with a prefix

FINISH_REASONS = frozenset({"stop", "length", "cancelled", "error"})

# Error codes the runtime uses; `Error.code` is not restricted to these so a newer peer can add one.
ERROR_BAD_REQUEST = "bad_request"
ERROR_PROTOCOL = "protocol"
ERROR_STAGE_DEAD = "stage_dead"
ERROR_OVERLOADED = "overloaded"
ERROR_INTERNAL = "internal"
ERROR_STAGE_UNRESPONSIVE = "stage_unresponsive"  # a stage sent no heartbeat for --stage-timeout seconds


def short(value: object, limit: int = 60) -> str:
    """repr of a peer-supplied value, cut so an error message (and the log line it becomes) stays small."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[: limit - 3]}..."


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _nonneg(name: str, value: int) -> None:
    _need(value >= 0, f"{name} must be >= 0, got {value}")


def _name(field: str, value: str) -> None:
    _need(0 < len(value) <= MAX_ID_CHARS, f"{field} must be 1..{MAX_ID_CHARS} characters, got {len(value)}")


def _indices(field: str, values: list[int], *, unique: bool = False) -> None:
    _need(len(values) > 0, f"{field} must not be empty")
    _need(min(values) >= 0, f"{field} must all be >= 0, got {min(values)}")
    if unique:
        if len(set(values)) != len(values):
            dups = sorted(v for v, n in Counter(values).items() if n > 1)
            raise ValueError(f"{field} has duplicates: {short(dups)}")


class Message:
    """Base of every wire message. `KIND` is the frame-0 byte; each subclass sets a unique one."""

    __slots__ = ()
    KIND: ClassVar[int]


# ---------------------------------------------------------------------------------------------------
# control: supervisor <-> stages and clients


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First message from a stage or client after connecting; the supervisor answers a version mismatch
    with `Error(code="protocol")` and drops the peer (see `handshake.check_hello`)."""

    KIND: ClassVar[int] = 0x01
    stage: str  # "reader", "ramtier", "executor", "client", ...
    pid: int
    protocol_version: int

    def __post_init__(self) -> None:
        _name("stage", self.stage)
        _need(self.pid > 0, f"pid must be > 0, got {self.pid}")


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """A stage finished initialising (arena attached, files opened, model loaded) and takes work.
    `info` is free-form but primitive: device name, budgets, slot counts, for `coli stats` and logs."""

    KIND: ClassVar[int] = 0x02
    stage: str
    info: dict[str, Any]

    def __post_init__(self) -> None:
        _name("stage", self.stage)


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Supervisor -> stage: finish or abandon in-flight work, release resources, exit 0."""

    KIND: ClassVar[int] = 0x03
    reason: str


@dataclass(frozen=True, slots=True)
class Stats(Message):
    """Periodic counters from a stage (hits, misses, bytes moved, busy seconds per engine). The
    supervisor republishes them for `coli stats`. `t` is the sender's time.time() in seconds."""

    KIND: ClassVar[int] = 0x04
    stage: str
    t: float
    counters: dict[str, int | float]

    def __post_init__(self) -> None:
        _name("stage", self.stage)
        _need(math.isfinite(self.t), f"t must be finite, got {self.t}")


@dataclass(frozen=True, slots=True)
class StageDead(Message):
    """Supervisor -> clients: a stage died; every request in flight fails with this typed error.
    `exitcode` is the process exit code (negative: killed by that signal), None if not known."""

    KIND: ClassVar[int] = 0x05
    stage: str
    reason: str
    exitcode: int | None = None

    def __post_init__(self) -> None:
        _name("stage", self.stage)


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A request failed, or a peer sent something unacceptable. `code` is one of the ERROR_* constants
    (open set); `request_id` names the request it answers, None when it answers no request."""

    KIND: ClassVar[int] = 0x06
    code: str
    message: str
    request_id: str | None = None

    def __post_init__(self) -> None:
        _name("code", self.code)


@dataclass(frozen=True, slots=True)
class StatusRequest(Message):
    """Client -> supervisor: describe the run (`coli status`)."""

    KIND: ClassVar[int] = 0x07
    request_id: str

    def __post_init__(self) -> None:
        _name("request_id", self.request_id)


@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    """Supervisor -> client: the run's model, budgets and each stage's pid, state and uptime, plus the
    latest stats counters of each stage (primitive values only)."""

    KIND: ClassVar[int] = 0x08
    request_id: str
    info: dict[str, Any]

    def __post_init__(self) -> None:
        _name("request_id", self.request_id)


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Stage -> supervisor (on its own `heartbeat` socket), every fraction of a second from a thread of
    the stage's own: the process is scheduled and alive. A stage that is stopped (SIGSTOP) or wedged as a
    whole goes quiet, and the supervisor calls it unresponsive after `--stage-timeout` seconds."""

    KIND: ClassVar[int] = 0x09
    stage: str
    pid: int
    t: float

    def __post_init__(self) -> None:
        _name("stage", self.stage)
        _need(self.pid > 0, f"pid must be > 0, got {self.pid}")
        _need(math.isfinite(self.t), f"t must be finite, got {self.t}")


# ---------------------------------------------------------------------------------------------------
# generation: client <-> supervisor <-> executor


MTP_MODES = ("off", "on", "auto", "1", "2", "3")


@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Client -> executor (through the supervisor): generate up to `max_tokens` after `prompt_ids`.

    `greedy` overrides the sampling settings (argmax). `top_k` 0 and `top_p` 1.0 disable those filters.
    `seed` None means the executor picks one. `session` names a conversation whose KV cache is kept
    between turns (and saved on shutdown): the executor reuses the longest prefix of `prompt_ids` it
    already holds and prefills only the rest; None for a one-shot request. An unknown session is an
    error unless `new_session` asks to create it. `ephemeral` (with `new_session`) makes a session that
    lives only in memory: never saved to disk, dropped instead of spilled when evicted (`coli chat`'s
    per-chat session; DropSession ends it)."""

    KIND: ClassVar[int] = 0x10
    request_id: str
    prompt_ids: list[int]  # [n_prompt] token ids
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    greedy: bool
    ignore_eos: bool
    session: str | None = None
    new_session: bool = False
    ephemeral: bool = False
    mtp: str | None = None  # MTP speculative decoding: off | on | 1..3 | auto (docs/mtp.md); None = the run's --mtp

    def __post_init__(self) -> None:
        _name("request_id", self.request_id)
        _need(self.mtp is None or self.mtp in MTP_MODES,
              f"mtp must be one of {', '.join(MTP_MODES)}, got {short(self.mtp)}")
        _indices("prompt_ids", self.prompt_ids)
        _need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _need(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be finite and >= 0, got {self.temperature}",
        )
        _need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _nonneg("top_k", self.top_k)
        if self.seed is not None:
            _need(0 <= self.seed < _U64, f"seed must be in [0, 2**64), got {self.seed}")
        if self.session is not None:
            _name("session", self.session)
            _need(all(c.isalnum() or c in "._-" for c in self.session),
                  f"session must be letters, digits, '.', '_' or '-', got {short(self.session)}")


@dataclass(frozen=True, slots=True)
class Token(Message):
    """Executor -> client: the `index`-th generated token (0-based) of a request."""

    KIND: ClassVar[int] = 0x11
    request_id: str
    token_id: int
    index: int

    def __post_init__(self) -> None:
        _name("request_id", self.request_id)
        _nonneg("token_id", self.token_id)
        _nonneg("index", self.index)


@dataclass(frozen=True, slots=True)
class Done(Message):
    """Executor -> client: the request finished. `finish_reason` is one of FINISH_REASONS; `tokens` is
    how many Token messages were sent; `timing` holds seconds by phase (prefill_s, decode_s, ...)."""

    KIND: ClassVar[int] = 0x12
    request_id: str
    finish_reason: str
    tokens: int
    timing: dict[str, float]

    def __post_init__(self) -> None:
        _name("request_id", self.request_id)
        _need(
            self.finish_reason in FINISH_REASONS,
            f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {short(self.finish_reason)}",
        )
        _nonneg("tokens", self.tokens)


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Client -> executor: stop generating for this request; it ends with Done(finish_reason="cancelled")."""

    KIND: ClassVar[int] = 0x13
    request_id: str

    def __post_init__(self) -> None:
        _name("request_id", self.request_id)


@dataclass(frozen=True, slots=True)
class DropSession(Message):
    """Client -> executor (through the supervisor): forget a session's KV cache, in memory and on disk. A
    session in use is dropped when its request ends. No reply (`coli chat` sends it as it exits)."""

    KIND: ClassVar[int] = 0x14
    session: str

    def __post_init__(self) -> None:
        _name("session", self.session)
        _need(all(c.isalnum() or c in "._-" for c in self.session),
              f"session must be letters, digits, '.', '_' or '-', got {short(self.session)}")


# ---------------------------------------------------------------------------------------------------
# expert residency: executor <-> RAM tier. Bulk bytes never ride a socket; SlotRef points into the arena.


@dataclass(frozen=True, slots=True)
class SlotRef(Message):
    """Where an expert record lies in shared memory: `nbytes` bytes at `offset` within slot `slot` of
    arena `arena`. `generation` is the slot's generation when the reference was made; a reader checks it
    again after copying out and discards the copy if the slot was recycled in between."""

    KIND: ClassVar[int] = 0x20
    arena: str
    slot: int
    offset: int  # bytes from the start of the slot, not of the arena
    nbytes: int
    generation: int

    def __post_init__(self) -> None:
        _name("arena", self.arena)
        _nonneg("slot", self.slot)
        _nonneg("offset", self.offset)
        _need(self.nbytes >= 1, f"nbytes must be >= 1, got {self.nbytes}")
        _nonneg("generation", self.generation)


@dataclass(frozen=True, slots=True)
class ExpertRequest(Message):
    """Executor -> RAM tier: make these experts of one MoE layer resident in RAM (batched per layer).
    `demand` True: the forward pass waits on them; False: a speculative prefetch that may be dropped."""

    KIND: ClassVar[int] = 0x21
    request_id: int
    layer: int
    experts: list[int]  # [n] expert indices within the layer, unique
    demand: bool

    def __post_init__(self) -> None:
        _nonneg("request_id", self.request_id)
        _nonneg("layer", self.layer)
        _indices("experts", self.experts, unique=True)


@dataclass(frozen=True, slots=True)
class ExpertReady(Message):
    """RAM tier -> executor: these experts of a request are in RAM. One request may be answered by
    several ExpertReady messages (RAM hits at once, disk misses as their reads land).
    `slots[i]` holds `experts[i]`; each slot is leased to the executor until ExpertRelease."""

    KIND: ClassVar[int] = 0x22
    request_id: int
    layer: int
    experts: list[int]  # [n]
    slots: list[SlotRef]  # [n], parallel to experts

    def __post_init__(self) -> None:
        _nonneg("request_id", self.request_id)
        _nonneg("layer", self.layer)
        _indices("experts", self.experts, unique=True)
        _need(
            len(self.slots) == len(self.experts),
            f"slots has {len(self.slots)} entries but experts has {len(self.experts)}",
        )


@dataclass(frozen=True, slots=True)
class ExpertFailed(Message):
    """RAM tier -> executor: these experts of a request cannot be made resident (read error, checksum
    mismatch, no free slot); the executor stops waiting for them and takes its fallback path."""

    KIND: ClassVar[int] = 0x23
    request_id: int
    layer: int
    experts: list[int]  # [n]
    reason: str

    def __post_init__(self) -> None:
        _nonneg("request_id", self.request_id)
        _nonneg("layer", self.layer)
        _indices("experts", self.experts, unique=True)


@dataclass(frozen=True, slots=True)
class ExpertRelease(Message):
    """Executor -> RAM tier: done reading these slots (the copy to VRAM or the CPU fallback finished).
    Each ExpertReady slot holds one lease that keeps it from being recycled; this gives them back.
    The refs are the ones ExpertReady carried, generation included, so a late release of a slot that
    was already recycled is recognised and ignored."""

    KIND: ClassVar[int] = 0x24
    refs: list[SlotRef]  # [n]

    def __post_init__(self) -> None:
        _need(len(self.refs) > 0, "refs must not be empty")


# ---------------------------------------------------------------------------------------------------
# NVMe reads: RAM tier <-> reader


@dataclass(frozen=True, slots=True)
class ReadRequest(Message):
    """RAM tier -> reader: read `length` bytes at `offset` of `file` (one expert record) into arena slot
    `slot`, and verify `checksum` (the container's record checksum) before reporting success."""

    KIND: ClassVar[int] = 0x30
    request_id: int
    layer: int
    expert: int
    slot: int
    file: str
    offset: int
    length: int
    checksum: int

    def __post_init__(self) -> None:
        for name in ("request_id", "layer", "expert", "slot", "offset"):
            _nonneg(name, getattr(self, name))
        _need(len(self.file) > 0, "file must not be empty")
        _need(self.length >= 1, f"length must be >= 1, got {self.length}")
        _need(0 <= self.checksum < _U64, f"checksum must be in [0, 2**64), got {self.checksum}")


@dataclass(frozen=True, slots=True)
class ReadDone(Message):
    """Reader -> RAM tier: the read of a ReadRequest landed (`ok`) or failed (`error` says why)."""

    KIND: ClassVar[int] = 0x31
    request_id: int
    layer: int
    expert: int
    slot: int
    ok: bool
    error: str | None = None

    def __post_init__(self) -> None:
        for name in ("request_id", "layer", "expert", "slot"):
            _nonneg(name, getattr(self, name))
        _need(self.ok == (self.error is None), f"ok={self.ok} disagrees with error={short(self.error)}")


# Every message type, in kind order. codec.py decodes only these; a test checks nothing is missing.
ALL_MESSAGES: tuple[type[Message], ...] = (
    Hello, Ready, Shutdown, Stats, StageDead, Error, StatusRequest, StatusReply, Heartbeat,
    GenerateRequest, Token, Done, Cancel, DropSession,
    SlotRef, ExpertRequest, ExpertReady, ExpertFailed, ExpertRelease,
    ReadRequest, ReadDone,
)  # fmt: skip


def _by_kind(types: tuple[type[Message], ...]) -> dict[int, type[Message]]:
    table: dict[int, type[Message]] = {}
    for cls in types:
        kind = cls.KIND
        if not 0x01 <= kind <= 0xFF:
            raise TypeError(f"{cls.__name__}.KIND {kind:#04x} is not a byte in 0x01..0xff")
        if kind in table:
            raise TypeError(f"{cls.__name__}.KIND {kind:#04x} is already used by {table[kind].__name__}")
        table[kind] = cls
    return table


MESSAGES_BY_KIND: dict[int, type[Message]] = _by_kind(ALL_MESSAGES)
