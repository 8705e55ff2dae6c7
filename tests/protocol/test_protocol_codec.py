"""Messages and codec: every kind round-trips; everything malformed is a ProtocolError naming the problem."""

from __future__ import annotations

import dataclasses
import inspect

import msgpack
import pytest

from coli.protocol import codec, messages as m
from coli.protocol.codec import MAX_MESSAGE_BYTES, decode, encode
from coli.protocol.errors import ProtocolError
from coli.protocol.handshake import check_hello, make_hello

pytestmark = pytest.mark.timeout(30)

REF = m.SlotRef(arena="coli-run-experts", slot=7, offset=0, nbytes=20_054_016, generation=3)

# One instance of every message, fields chosen to exercise each annotation (None and non-None arms,
# nested records, empty and non-empty dicts, uint64 extremes).
SAMPLES: list[m.Message] = [
    m.StatusRequest(request_id="st-1"),
    m.StatusReply(request_id="st-1", info={"model": "/m", "stages": {"reader": {"pid": 7, "state": "ready"}}}),
    m.Hello(stage="reader", pid=4242, protocol_version=m.PROTOCOL_VERSION),
    m.Ready(
        stage="executor",
        info={"device": "H200", "vram_slots": 96, "budgets": {"ram_gib": 64.0}, "tags": ["a", None, True]},
    ),
    m.Shutdown(reason="user asked"),
    m.Stats(stage="ramtier", t=1_764_470_000.25, counters={"hits": 10, "busy_s": 0.5}),
    m.StageDead(stage="reader", reason="killed by SIGKILL", exitcode=-9),
    m.StageDead(stage="reader", reason="lost", exitcode=None),
    m.Heartbeat(stage="executor", pid=4242, t=1_764_470_000.5),
    m.Error(code=m.ERROR_BAD_REQUEST, message="prompt too long", request_id="req-1"),
    m.Error(code=m.ERROR_PROTOCOL, message="bad frame", request_id=None),
    m.GenerateRequest(
        request_id="chatcmpl-1", prompt_ids=[1, 154_879, 0], max_tokens=32, temperature=0.7, top_p=0.95,
        top_k=40, seed=(1 << 64) - 1, greedy=False, ignore_eos=True, session="s1",
    ),
    m.GenerateRequest(
        request_id="r2", prompt_ids=[5], max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=None,
        greedy=True, ignore_eos=False, session=None,
    ),
    m.Token(request_id="r2", token_id=154_879, index=0),
    m.Done(request_id="r2", finish_reason="length", tokens=1, timing={"prefill_s": 0.25, "decode_s": 1.5}),
    m.Cancel(request_id="r2"),
    m.GenerateRequest(
        request_id="r3", prompt_ids=[5, 6], max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, seed=None,
        greedy=True, ignore_eos=False, session="chat-1a2b", new_session=True, ephemeral=True,
    ),
    m.DropSession(session="chat-1a2b"),
    REF,
    m.ExpertRequest(request_id=1, layer=74, experts=[0, 255, 17], demand=True),
    m.ExpertReady(request_id=1, layer=74, experts=[255, 17], slots=[REF, dataclasses.replace(REF, slot=8)]),
    m.ExpertFailed(request_id=1, layer=74, experts=[0], reason="checksum mismatch in experts.bin at 4096"),
    m.ExpertRelease(refs=[REF]),
    m.ReadRequest(
        request_id=9, layer=3, expert=200, slot=7, file="experts-00001.bin", offset=1 << 40,
        length=20_054_016, checksum=(1 << 64) - 1,
    ),
    m.ReadDone(request_id=9, layer=3, expert=200, slot=7, ok=True, error=None),
    m.ReadDone(request_id=9, layer=3, expert=200, slot=7, ok=False, error="EIO"),
]


def first(cls: type[m.Message]) -> m.Message:
    return next(s for s in SAMPLES if type(s) is cls)


def frames_of(kind: type[m.Message], body: object) -> list[bytes]:
    return [bytes([kind.KIND]), msgpack.packb(body, use_bin_type=True)]


def wire_fields(msg: m.Message) -> dict:
    return msgpack.unpackb(encode(msg)[1], raw=False)


# -- definitions ----------------------------------------------------------------------------------------


def test_every_message_class_is_registered_with_a_unique_kind():
    defined = {
        obj for obj in vars(m).values()
        if inspect.isclass(obj) and issubclass(obj, m.Message) and obj is not m.Message
    }  # fmt: skip
    assert defined == set(m.ALL_MESSAGES)
    kinds = [cls.KIND for cls in m.ALL_MESSAGES]
    assert len(set(kinds)) == len(kinds) and 0 not in kinds
    assert all(0 < k <= 0xFF for k in kinds)
    assert {cls.KIND: cls for cls in m.ALL_MESSAGES} == m.MESSAGES_BY_KIND


def test_messages_are_frozen_dataclasses():
    for cls in m.ALL_MESSAGES:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        first(m.Hello).pid = 1  # type: ignore[misc]


def test_samples_cover_every_kind():
    assert {type(s) for s in SAMPLES} == set(m.ALL_MESSAGES)


# -- round trips ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg):
    frames = encode(msg)
    assert len(frames) == 2 and frames[0] == bytes([msg.KIND])
    assert isinstance(frames[1], bytes)
    back = decode(frames)
    assert type(back) is type(msg) and back == msg


def test_decode_accepts_any_bytes_like_frames():
    kind, body = encode(first(m.Hello))
    assert decode([bytearray(kind), memoryview(body)]) == first(m.Hello)
    assert decode((kind, body)) == first(m.Hello)


def test_float_field_accepts_int_and_decodes_to_float():
    body = wire_fields(first(m.Stats)) | {"t": 5}
    msg = decode(frames_of(m.Stats, body))
    assert msg.t == 5.0 and type(msg.t) is float


def test_long_prompt_round_trips_under_the_size_limit():
    prompt = list(range(150_000, 154_000)) * 50  # 200k tokens, ids needing 32 bits
    msg = dataclasses.replace(first(m.GenerateRequest), prompt_ids=prompt)
    frames = encode(msg)
    assert len(frames[1]) < MAX_MESSAGE_BYTES
    assert decode(frames) == msg


def test_hello_helpers():
    hello = make_hello("reader")
    assert check_hello(decode(encode(hello)), stage="reader") == hello


# -- malformed input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "expected 2 frames"),
        ([b"\x01"], "expected 2 frames"),
        ([b"\x01", b"\x80", b"extra"], "expected 2 frames"),
        ([b"", b"\x80"], "frame 0 must be one kind byte"),
        ([b"\x01\x01", b"\x80"], "frame 0 must be one kind byte"),
        ([b"\x00", b"\x80"], "unknown message kind 0x00"),
        ([b"\xee", b"\x80"], "unknown message kind 0xee"),
        ([b"\x01", b""], "not valid msgpack"),
        ([b"\x01", b"\xc1"], "not valid msgpack"),  # 0xc1 is never used in msgpack
        ([b"\x01", b"\xff\xfe\xfd garbage"], "not valid msgpack"),
        ([b"\x01", msgpack.packb({"stage": "a"}) + b"\x00"], "not valid msgpack"),  # trailing bytes
        ([b"\x01", msgpack.packb({1: "int key"})], "not valid msgpack"),
        ([b"\x01", b"\x81\xa5stage\xa2\xff\xfe"], "not valid msgpack"),  # invalid UTF-8
        ([b"\x01", b"\xc4\x03abc"], "not valid msgpack"),  # bin: no message carries bytes
        ([b"\x01", b"\xd4\x05\x00"], "not valid msgpack"),  # ext type
        ([b"\x01", b"\xd6\xff\x00\x00\x00\x01"], "not valid msgpack"),  # msgpack timestamp ext
        ([b"\x01", msgpack.packb([1, 2, 3])], "expected a msgpack map of Hello fields, got list"),
        ([b"\x01", msgpack.packb("hello")], "expected a msgpack map of Hello fields, got str"),
        ([b"\x01", msgpack.packb(None)], "got NoneType"),
    ],
)
def test_malformed_frames(frames, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_truncated_msgpack_at_every_length():
    _, body = encode(first(m.GenerateRequest))
    for cut in range(len(body)):
        with pytest.raises(ProtocolError, match="not valid msgpack|missing field"):
            decode([bytes([m.GenerateRequest.KIND]), body[:cut]])


def test_duplicate_keys_refused():
    # {"stage": "a", "stage": "b", ...}: msgpack allows it, dict() would silently keep the last
    body = b"\x84" + b"".join(msgpack.packb(x) for x in ["stage", "a", "stage", "b", "pid", 1, "protocol_version", 1])
    with pytest.raises(ProtocolError, match="duplicate map key 'stage'"):
        decode([bytes([m.Hello.KIND]), body])


def test_oversized_body_refused_before_unpacking():
    big = b"\xdb" + (MAX_MESSAGE_BYTES).to_bytes(4, "big") + b"x" * MAX_MESSAGE_BYTES  # str32 > limit
    with pytest.raises(ProtocolError, match=r"Shutdown body is \d+ bytes, over MAX_MESSAGE_BYTES"):
        decode([bytes([m.Shutdown.KIND]), big])


def test_oversized_message_refused_on_encode():
    with pytest.raises(ProtocolError, match="Shutdown encodes to .* over MAX_MESSAGE_BYTES"):
        encode(m.Shutdown(reason="x" * MAX_MESSAGE_BYTES))


def test_array_and_map_limits():
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        # an array header claiming more items than MAX_ARRAY_ITEMS, in a small body
        decode([bytes([m.Cancel.KIND]), b"\xdd" + (codec.MAX_ARRAY_ITEMS + 1).to_bytes(4, "big")])
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([bytes([m.Cancel.KIND]), b"\xdf" + (codec.MAX_MAP_ITEMS + 1).to_bytes(4, "big")])
    counters = {f"c{i}": i for i in range(codec.MAX_MAP_ITEMS + 1)}
    with pytest.raises(ProtocolError, match="Stats.counters: 4097 entries, over MAX_MAP_ITEMS"):
        encode(m.Stats(stage="x", t=0.0, counters=counters))


def test_missing_and_extra_keys():
    body = wire_fields(first(m.ExpertRequest))
    del body["demand"]
    with pytest.raises(ProtocolError, match="ExpertRequest: missing field.s. demand"):
        decode(frames_of(m.ExpertRequest, body))
    body = wire_fields(first(m.ExpertRequest)) | {"priority": 1}
    with pytest.raises(ProtocolError, match="ExpertRequest: unexpected field.s. 'priority'"):
        decode(frames_of(m.ExpertRequest, body))
    body = wire_fields(first(m.ExpertReady))
    del body["slots"][1]["generation"]
    with pytest.raises(ProtocolError, match=r"ExpertReady.slots\[1\]: missing field.s. generation"):
        decode(frames_of(m.ExpertReady, body))


@pytest.mark.parametrize(
    "cls, field, value, match",
    [
        (m.Hello, "pid", "4242", r"Hello.pid: expected int, got str"),
        (m.Hello, "pid", True, r"Hello.pid: expected int, got bool"),
        (m.Hello, "pid", 1.0, r"Hello.pid: expected int, got float"),
        (m.Hello, "stage", None, r"Hello.stage: expected str, got NoneType"),
        (m.Stats, "t", "now", r"Stats.t: expected float, got str"),
        (m.Stats, "t", False, r"Stats.t: expected float, got bool"),
        (m.Stats, "counters", [1], r"Stats.counters: expected dict, got list"),
        (m.Stats, "counters", {"hits": "many"}, r"Stats.counters\['hits'\]: expected int \| float, got str"),
        (m.ExpertRequest, "demand", 1, r"ExpertRequest.demand: expected bool, got int"),
        (m.ExpertRequest, "experts", 3, r"ExpertRequest.experts: expected list\[int\], got int"),
        (m.ExpertRequest, "experts", [1, "2"], r"ExpertRequest.experts\[1\]: expected int, got str"),
        (m.ExpertRequest, "experts", [1, None], r"ExpertRequest.experts\[1\]: expected int, got NoneType"),
        (m.GenerateRequest, "seed", "7", r"GenerateRequest.seed: expected int \| None, got str"),
        (m.GenerateRequest, "session", 5, r"GenerateRequest.session: expected str \| None, got int"),
        (m.ExpertReady, "slots", [[1, 2]], r"ExpertReady.slots\[0\]: expected a msgpack map of SlotRef fields"),
        (m.ReadDone, "error", 0, r"ReadDone.error: expected str \| None, got int"),
    ],
)
def test_wrong_field_types(cls, field, value, match):
    body = wire_fields(first(cls)) | {field: value}
    with pytest.raises(ProtocolError, match=match):
        decode(frames_of(cls, body))


def test_error_messages_stay_short_whatever_the_peer_sent():
    huge = "z" * 1_000_000
    cases = [
        (m.Done, wire_fields(first(m.Done)) | {"finish_reason": huge}),
        (m.Cancel, {"request_id": "r", huge: 1}),
        (m.Stats, wire_fields(first(m.Stats)) | {"counters": {huge: "x"}}),
        (m.ExpertRequest, wire_fields(first(m.ExpertRequest)) | {"experts": [7] * 500_000}),
    ]
    for cls, body in cases:
        with pytest.raises(ProtocolError) as e:
            decode(frames_of(cls, body))
        assert len(str(e.value)) < 300, str(e.value)[:300]
    assert "experts has duplicates: [7]" in str(e.value)


def test_nested_record_field_type():
    body = wire_fields(first(m.ExpertReady))
    body["slots"][0]["slot"] = "seven"
    with pytest.raises(ProtocolError, match=r"ExpertReady.slots\[0\].slot: expected int, got str"):
        decode(frames_of(m.ExpertReady, body))


def test_any_values_are_primitive_trees_with_bounded_depth():
    deep: object = 1
    for _ in range(codec.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ProtocolError, match="nested at most"):
        decode(frames_of(m.Ready, {"stage": "x", "info": {"deep": deep}}))
    with pytest.raises(ProtocolError, match=r"Ready.info\['x'\] key 1: expected str"):
        encode(m.Ready(stage="x", info={"x": {1: "int key"}}))
    with pytest.raises(ProtocolError, match=r"Ready.info\['t'\]: expected None, bool, .* or dict, got tuple"):
        encode(m.Ready(stage="x", info={"t": (1, 2)}))


@pytest.mark.parametrize(
    "cls, field, value, match",
    [
        (m.ReadRequest, "slot", -1, "slot must be >= 0, got -1"),
        (m.ReadRequest, "length", 0, "length must be >= 1"),
        (m.ExpertRequest, "experts", [], "experts must not be empty"),
        (m.ExpertRequest, "experts", [3, 3], "experts has duplicates"),
        (m.ExpertReady, "experts", [1], "slots has 2 entries but experts has 1"),
        (m.GenerateRequest, "top_p", 0.0, r"top_p must be in \(0, 1\]"),
        (m.GenerateRequest, "temperature", float("nan"), "temperature must be finite"),
        (m.GenerateRequest, "max_tokens", 0, "max_tokens must be >= 1"),
        (m.GenerateRequest, "prompt_ids", [1, -5], "prompt_ids must all be >= 0, got -5"),
        (m.Done, "finish_reason", "bored", "finish_reason must be one of"),
        (m.ReadDone, "error", "EIO", "ok=True disagrees with error='EIO'"),
        (m.Hello, "stage", "", "stage must be 1..128 characters"),
    ],
)
def test_invariants_checked_on_decode(cls, field, value, match):
    body = wire_fields(first(cls)) | {field: value}
    with pytest.raises(ProtocolError, match=rf"{cls.__name__}: {match}"):
        decode(frames_of(cls, body))
    with pytest.raises(ValueError, match=match):  # and the sender cannot build it either
        dataclasses.replace(first(cls), **{field: value})


def test_ints_msgpack_cannot_carry_are_refused_on_encode():
    msg = dataclasses.replace(first(m.GenerateRequest), prompt_ids=[1, 1 << 64])
    with pytest.raises(ProtocolError, match=r"GenerateRequest.prompt_ids\[1\]: expected int in int64..uint64 range"):
        encode(msg)


def test_encode_refuses_what_it_cannot_send():
    with pytest.raises(ProtocolError, match="cannot encode dict: not a protocol message"):
        encode({"kind": 1})  # type: ignore[arg-type]
    import numpy as np

    msg = m.ExpertRequest(request_id=1, layer=2, experts=[int(x) for x in range(3)], demand=True)
    bad = dataclasses.replace(msg, experts=[0, np.int64(5)])  # straight from a router's argsort
    with pytest.raises(ProtocolError, match=r"ExpertRequest.experts\[1\]: expected int, got numpy.int64"):
        encode(bad)
    with pytest.raises(ProtocolError, match=r"ExpertRequest.experts: expected list\[int\], got tuple"):
        encode(dataclasses.replace(msg, experts=(1, 2)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"ExpertReady.slots\[0\]: expected SlotRef, got dict"):
        encode(m.ExpertReady(request_id=1, layer=1, experts=[1], slots=[{"arena": "a"}]))  # type: ignore[list-item]


def test_int_enum_and_numpy_float_are_normalised():
    import enum

    import numpy as np

    class Layer(enum.IntEnum):
        L3 = 3

    msg = m.Stats(stage="x", t=np.float64(2.5), counters={"a": np.float64(1.5)})  # type: ignore[arg-type]
    assert decode(encode(msg)) == m.Stats(stage="x", t=2.5, counters={"a": 1.5})
    msg2 = m.ExpertRequest(request_id=1, layer=Layer.L3, experts=[1], demand=False)
    back = decode(encode(msg2))
    assert back.layer == 3 and type(back.layer) is int


# -- handshake --------------------------------------------------------------------------------------------


def test_check_hello_refuses_wrong_version_kind_and_stage():
    old = m.Hello(stage="reader", pid=77, protocol_version=m.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError, match=r"'reader' \(pid 77\) speaks protocol version 2, this process speaks 1"):
        check_hello(decode(encode(old)))
    with pytest.raises(ProtocolError, match="expected Hello as the first message, got Ready"):
        check_hello(m.Ready(stage="reader", info={}))
    with pytest.raises(ProtocolError, match="expected Hello from stage 'executor', got one from 'reader'"):
        check_hello(make_hello("reader"), stage="executor")
