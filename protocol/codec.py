"""msgpack codec for the messages in `messages.py`: two frames per message, strict on both sides.

Wire format (one ZeroMQ multipart message, after any ROUTER identity frames):

    frame 0: one byte, the message's KIND
    frame 1: a msgpack map {field name: value} holding exactly the dataclass's fields

No pickle and no msgpack ext types anywhere: a peer can only ever make us build the primitives the
annotations allow. Sizes are bounded before anything is unpacked (MAX_MESSAGE_BYTES) and while unpacking
(array, map and string limits), every field is checked against its annotation, unknown and missing keys
are refused, and duplicate map keys are refused. Encoding runs the same checks, so a bug in a sender
fails in the sender, naming the field, instead of in the receiver.

Annotations the codec understands: int, float (accepts an int, decodes to float), str, bool, None,
`X | Y` unions, list[X], dict[str, X], Any (a tree of those primitives, at most MAX_DEPTH deep), and a
nested message dataclass (sent as a map, like SlotRef inside ExpertReady).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from .errors import ProtocolError
from .messages import ALL_MESSAGES, MESSAGES_BY_KIND, Message, short

# A 200k-token prompt of uint32 ids is ~1 MB of msgpack; 4 MiB leaves room and still bounds what one
# peer can make a stage allocate. Control messages are normally a few hundred bytes.
MAX_MESSAGE_BYTES = 4 << 20
MAX_ARRAY_ITEMS = 1 << 20  # longest list in any message (prompt_ids)
MAX_MAP_ITEMS = 4096  # largest dict (Stats.counters, Ready.info)
MAX_DEPTH = 8  # nesting of Any-typed values (Ready.info)

_INT_MIN, _INT_LIMIT = -(1 << 63), 1 << 64  # what msgpack can carry: int64 .. uint64


class _Bad(Exception):
    """Internal: a value is not what its field allows. The message starts with the path of the value
    (`ExpertReady.slots[2].slot`); the public functions re-raise it as ProtocolError."""

    @classmethod
    def typed(cls, path: str, expected: str, value: Any) -> _Bad:
        return cls(f"{path}: expected {expected}, got {_typename(value)}")


def _typename(value: Any) -> str:
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# A converter checks one value against one annotation and returns it as it should be on the wire
# (to_wire=True) or in the dataclass (to_wire=False). `depth` bounds recursion through Any values.
_Conv = Callable[[Any, str, bool, int], Any]


def _conv_int(v: Any, path: str, to_wire: bool, depth: int) -> int:
    # bool is an int subclass; True for a slot index is a bug, not a 1
    if not isinstance(v, int) or isinstance(v, bool):
        raise _Bad.typed(path, "int", v)
    if not _INT_MIN <= v < _INT_LIMIT:
        raise _Bad.typed(path, "int in int64..uint64 range", v)
    return int(v)  # normalises IntEnum and other subclasses


def _conv_float(v: Any, path: str, to_wire: bool, depth: int) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _Bad.typed(path, "float", v)
    return float(v)


def _conv_str(v: Any, path: str, to_wire: bool, depth: int) -> str:
    if not isinstance(v, str):
        raise _Bad.typed(path, "str", v)
    return str(v)


def _conv_bool(v: Any, path: str, to_wire: bool, depth: int) -> bool:
    if not isinstance(v, bool):
        raise _Bad.typed(path, "bool", v)
    return v


def _conv_none(v: Any, path: str, to_wire: bool, depth: int) -> None:
    if v is not None:
        raise _Bad.typed(path, "None", v)
    return None


def _conv_any(v: Any, path: str, to_wire: bool, depth: int) -> Any:
    """A primitive tree: what JSON could hold, with str-keyed maps."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return _conv_int(v, path, to_wire, depth)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    if depth >= MAX_DEPTH:
        raise _Bad.typed(path, f"a value nested at most {MAX_DEPTH} deep", v)
    if isinstance(v, list):
        return [_conv_any(x, f"{path}[{i}]", to_wire, depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Bad.typed(f"{path} key {short(k)}", "str", k)
            out[k] = _conv_any(x, f"{path}[{short(k)}]", to_wire, depth + 1)
        return out
    raise _Bad.typed(path, "None, bool, int, float, str, list or dict", v)


_PRIMITIVES: dict[Any, tuple[_Conv, tuple[type, ...]]] = {
    # annotation: (converter, exact wire types that need no conversion — the fast path for long lists)
    int: (_conv_int, (int,)),
    float: (_conv_float, (float,)),
    str: (_conv_str, (str,)),
    bool: (_conv_bool, (bool,)),
    type(None): (_conv_none, (type(None),)),
}


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _compile(tp: Any, where: str) -> _Conv:
    """Build the converter for one annotation; an annotation outside the supported set is a bug in
    messages.py and fails at import time."""
    if tp in _PRIMITIVES:
        return _PRIMITIVES[tp][0]
    if tp is Any:
        return _conv_any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _compile_union(tp, [_compile(a, where) for a in args])
    if origin is list:
        return _compile_list(args[0], _compile(args[0], where))
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str (msgpack strict_map_key), not {args[0]}")
        return _compile_dict(_compile(args[1], where))
    if isinstance(tp, type) and issubclass(tp, Message) and dataclasses.is_dataclass(tp):
        return _compile_record(tp)
    raise TypeError(f"{where}: annotation {tp!r} is not supported by the codec")


def _compile_union(tp: Any, arms: list[_Conv]) -> _Conv:
    expected = _describe(tp)

    def conv(v: Any, path: str, to_wire: bool, depth: int) -> Any:
        for arm in arms:
            try:
                return arm(v, path, to_wire, depth)
            except _Bad:
                continue
        raise _Bad.typed(path, expected, v)

    return conv


def _compile_list(item_tp: Any, item: _Conv) -> _Conv:
    fast = _PRIMITIVES.get(item_tp, (None, ()))[1]

    def conv(v: Any, path: str, to_wire: bool, depth: int) -> list:
        if not isinstance(v, list):  # a tuple would come back as a list: refuse the asymmetry
            raise _Bad.typed(path, f"list[{_describe(item_tp)}]", v)
        if len(v) > MAX_ARRAY_ITEMS:
            raise _Bad(f"{path}: {len(v)} items, over MAX_ARRAY_ITEMS={MAX_ARRAY_ITEMS}")
        # 200k-token prompts: check exact primitive types in one fast pass and hand the list over as is;
        # anything else (or an int out of range) takes the per-item loop, which names the bad index
        if fast and all(type(x) in fast for x in v):
            if item_tp is not int or not v or (_INT_MIN <= min(v) and max(v) < _INT_LIMIT):
                return v
        return [item(x, f"{path}[{i}]", to_wire, depth) for i, x in enumerate(v)]

    return conv


def _compile_dict(value: _Conv) -> _Conv:
    def conv(v: Any, path: str, to_wire: bool, depth: int) -> dict:
        if not isinstance(v, dict):
            raise _Bad.typed(path, "dict", v)
        if len(v) > MAX_MAP_ITEMS:
            raise _Bad(f"{path}: {len(v)} entries, over MAX_MAP_ITEMS={MAX_MAP_ITEMS}")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Bad.typed(f"{path} key {short(k)}", "str", k)
            out[k] = value(x, f"{path}[{short(k)}]", to_wire, depth)
        return out

    return conv


class _Spec:
    """A message class's fields and their converters, compiled once at import."""

    def __init__(self, cls: type[Message]) -> None:
        hints = typing.get_type_hints(cls)
        self.cls = cls
        self.name = cls.__name__
        self.fields: tuple[tuple[str, _Conv], ...] = tuple(
            (f.name, _compile(hints[f.name], f"{cls.__name__}.{f.name}")) for f in dataclasses.fields(cls)
        )
        self.names = frozenset(name for name, _ in self.fields)
        self.kind_frame = bytes([cls.KIND])

    def to_wire(self, msg: Message, path: str, depth: int) -> dict[str, Any]:
        return {name: conv(getattr(msg, name), f"{path}.{name}", True, depth) for name, conv in self.fields}

    def from_wire(self, body: Any, path: str, depth: int) -> Message:
        if not isinstance(body, dict):
            raise _Bad.typed(path, f"a msgpack map of {self.name} fields", body)
        if body.keys() != self.names:
            missing = sorted(self.names - body.keys())
            extra = sorted(map(short, body.keys() - self.names))[:8]
            parts = ([f"missing field(s) {', '.join(missing)}"] if missing else []) + (
                [f"unexpected field(s) {', '.join(extra)}"] if extra else []
            )
            raise _Bad(f"{path}: {'; '.join(parts)}")
        values = {name: conv(body[name], f"{path}.{name}", False, depth) for name, conv in self.fields}
        try:
            return self.cls(**values)
        except (ValueError, TypeError) as e:  # __post_init__ invariants
            raise _Bad(f"{path}: {e}") from None


def _compile_record(cls: type[Message]) -> _Conv:
    spec_ref: list[_Spec] = []  # filled lazily: a record type may be compiled before its own spec exists

    def conv(v: Any, path: str, to_wire: bool, depth: int) -> Any:
        if not spec_ref:
            spec_ref.append(_SPECS[cls])
        spec = spec_ref[0]
        if to_wire:
            if type(v) is not cls:
                raise _Bad.typed(path, cls.__name__, v)
            return spec.to_wire(v, path, depth + 1)
        return spec.from_wire(v, path, depth + 1)

    return conv


_SPECS: dict[type[Message], _Spec] = {cls: _Spec(cls) for cls in ALL_MESSAGES}


def encode(msg: Message) -> list[bytes]:
    """`msg` as [kind frame, msgpack body]. Raises ProtocolError naming the field that cannot be sent."""
    spec = _SPECS.get(type(msg))
    if spec is None:
        raise ProtocolError(f"cannot encode {_typename(msg)}: not a protocol message (see messages.ALL_MESSAGES)")
    try:
        body = msgpack.packb(spec.to_wire(msg, spec.name, 0), use_bin_type=True)  # no `default` hook
    except _Bad as e:
        raise ProtocolError(str(e)) from None
    except (TypeError, ValueError, OverflowError) as e:  # msgpack refused what the checks let through
        raise ProtocolError(f"{spec.name} cannot be packed ({type(e).__name__}: {e})") from None
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{spec.name} encodes to {len(body)} bytes, over MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    return [spec.kind_frame, body]


def _no_duplicate_keys(pairs: list[tuple[Any, Any]]) -> dict:
    # msgpack allows a key twice and dict() would keep the last silently; a peer doing that is broken
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate map key {k!r}")
            seen.add(k)
    return out


def decode(frames: Sequence[Any]) -> Message:
    """The message in `frames` ([kind, body], each bytes-like). Raises ProtocolError naming what was wrong:
    frame count, kind, size, msgpack syntax, field set, field type or field invariant."""
    if len(frames) != 2:
        sizes = ", ".join(str(memoryview(f).nbytes) for f in frames[:8])
        raise ProtocolError(f"expected 2 frames (kind byte, msgpack body), got {len(frames)} (sizes: {sizes})")
    kind_frame, body = memoryview(frames[0]), memoryview(frames[1])
    if kind_frame.nbytes != 1:
        raise ProtocolError(f"frame 0 must be one kind byte, got {kind_frame.nbytes} bytes")
    kind = kind_frame.tobytes()[0]
    cls = MESSAGES_BY_KIND.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind:#04x} ({body.nbytes}-byte body)")
    spec = _SPECS[cls]
    if body.nbytes > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{spec.name} body is {body.nbytes} bytes, over MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    try:
        fields = msgpack.unpackb(
            body,
            raw=False,  # str is UTF-8 text; invalid UTF-8 is an error, not bytes
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_no_duplicate_keys,
            max_str_len=MAX_MESSAGE_BYTES,
            max_bin_len=0,  # bulk bytes never ride a socket: no message has a bytes field
            max_ext_len=0,  # no ext types, so no hook can ever run on peer data
            max_array_len=MAX_ARRAY_ITEMS,
            max_map_len=MAX_MAP_ITEMS,
        )
    except Exception as e:  # any failure to parse peer bytes is the peer's malformed message
        raise ProtocolError(f"{spec.name} body is not valid msgpack ({type(e).__name__}: {e})") from None
    try:
        return spec.from_wire(fields, spec.name, 0)
    except _Bad as e:
        raise ProtocolError(str(e)) from None
