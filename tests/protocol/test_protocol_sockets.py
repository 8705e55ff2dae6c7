"""Real ZeroMQ exchanges over ipc:// in a run dir: bad messages raise ProtocolError, the next good one
still arrives, and the socket options the runtime relies on are set."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import msgpack
import pytest
import zmq

from coli.protocol import messages as m
from coli.protocol.codec import MAX_MESSAGE_BYTES
from coli.protocol.errors import ProtocolError, RunDirError
from coli.protocol.handshake import check_hello, make_hello
from coli.protocol.rundir import RunDir
from coli.protocol.sockets import DEFAULT_HWM, make_socket, recv, recv_from, send

pytestmark = pytest.mark.timeout(30)

TIMEOUT_MS = 5000


@pytest.fixture
def run():
    base = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    yield RunDir("t", base=base)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def bounded(sock: zmq.Socket) -> zmq.Socket:
    # a broken test fails with zmq.Again instead of hanging until pytest-timeout
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
    return sock


GARBAGE = [
    [b"\x01"],  # one frame
    [b"\x01", b"\x80", b"\x80"],  # three frames
    [b"\xee", msgpack.packb({})],  # unknown kind
    [b"\x01", b"\xc1 not msgpack"],  # garbage body
    [b"\x01", msgpack.packb({"stage": "x", "pid": 1})],  # missing key
    [b"\x01", msgpack.packb({"stage": "x", "pid": "1", "protocol_version": 1})],  # wrong type
    [b"", b""],  # empty frames
]


def test_router_survives_garbage_and_keeps_receiving(run, ctx):
    endpoint = run.endpoint("supervisor")
    router = bounded(make_socket(ctx, zmq.ROUTER, endpoint, bind=True))
    dealer = bounded(make_socket(ctx, zmq.DEALER, endpoint, bind=False, identity=b"reader"))
    assert (run.path / "supervisor.sock").exists()

    for frames in GARBAGE:
        dealer.send_multipart(frames)
        send(dealer, make_hello("reader"))  # a good message right behind each bad one
        with pytest.raises(ProtocolError) as bad:
            recv_from(router)
        assert bad.value.peer == b"reader" and "from peer b'reader'" in str(bad.value)
        peer, msg = recv_from(router)
        assert peer == b"reader" and check_hello(msg, stage="reader").stage == "reader"

    send(router, m.Ready(stage="supervisor", info={"slots": 4}), peer=b"reader")
    assert recv(dealer) == m.Ready(stage="supervisor", info={"slots": 4})


def test_router_refuses_to_send_to_an_unknown_peer(run, ctx):
    router = bounded(make_socket(ctx, zmq.ROUTER, run.endpoint("supervisor"), bind=True))
    with pytest.raises(zmq.ZMQError) as e:
        send(router, m.Shutdown(reason="x"), peer=b"nobody")
    assert e.value.errno == zmq.EHOSTUNREACH


def test_pair_exchange_with_garbage(run, ctx):
    endpoint = run.endpoint("reader")
    a = bounded(make_socket(ctx, zmq.PAIR, endpoint, bind=True))
    b = bounded(make_socket(ctx, zmq.PAIR, endpoint, bind=False))
    req = m.ReadRequest(request_id=1, layer=0, expert=5, slot=2, file="e.bin", offset=0, length=4096, checksum=7)
    b.send_multipart([b"\x30", b"\x81\xa4junk\x01"])
    send(b, req)
    with pytest.raises(ProtocolError, match="ReadRequest: missing field"):
        recv(a)
    assert recv(a) == req
    send(a, m.ReadDone(request_id=1, layer=0, expert=5, slot=2, ok=True))
    assert recv(b).ok is True


def test_oversized_message_is_a_protocol_error_and_a_huge_one_is_dropped_by_zmq(run, ctx):
    endpoint = run.endpoint("supervisor")
    router = bounded(make_socket(ctx, zmq.ROUTER, endpoint, bind=True))
    over = bounded(make_socket(ctx, zmq.DEALER, endpoint, bind=False, identity=b"over"))
    hog = bounded(make_socket(ctx, zmq.DEALER, endpoint, bind=False, identity=b"hog"))
    good = bounded(make_socket(ctx, zmq.DEALER, endpoint, bind=False, identity=b"good"))
    # just over the codec's limit: it reaches the stage, which refuses it (and logs a ProtocolError)
    over.send_multipart([bytes([m.Shutdown.KIND]), b"x" * (MAX_MESSAGE_BYTES + 1)])
    with pytest.raises(ProtocolError, match="MAX_MESSAGE_BYTES"):
        recv_from(router)
    # past 4x the limit libzmq drops the peer before anything is allocated for it
    hog.send_multipart([bytes([m.Shutdown.KIND]), b"x" * (4 * MAX_MESSAGE_BYTES + 1)])
    send(good, m.Cancel(request_id="r1"))
    assert recv_from(router) == (b"good", m.Cancel(request_id="r1"))
    assert router.poll(300) == 0  # the huge message never reached the stage


def test_sub_receives_only_the_kinds_it_asked_for(run, ctx):
    endpoint = run.endpoint("stats")
    pub = bounded(make_socket(ctx, zmq.PUB, endpoint, bind=True))
    sub = bounded(make_socket(ctx, zmq.SUB, endpoint, bind=False, subscribe=[m.Stats]))
    stats = m.Stats(stage="reader", t=1.0, counters={"reads": 3})
    # PUB drops messages until the subscription has propagated: publish until one arrives
    for _ in range(200):
        send(pub, m.Shutdown(reason="not for the subscriber"))
        send(pub, stats)
        if sub.poll(25):
            break
    assert recv(sub) == stats
    while sub.poll(50):
        assert isinstance(recv(sub), m.Stats)


def test_socket_options(run, ctx):
    s = make_socket(ctx, zmq.DEALER, run.endpoint("client"), bind=False, hwm=16)
    assert s.getsockopt(zmq.LINGER) == 0
    assert s.getsockopt(zmq.SNDHWM) == 16 and s.getsockopt(zmq.RCVHWM) == 16
    assert s.getsockopt(zmq.MAXMSGSIZE) == 4 * MAX_MESSAGE_BYTES
    s.close()
    d = make_socket(ctx, zmq.DEALER, run.endpoint("client"), bind=False)
    assert d.getsockopt(zmq.SNDHWM) == DEFAULT_HWM
    d.close()
    with pytest.raises(ValueError, match="hwm must be >= 1"):
        make_socket(ctx, zmq.DEALER, run.endpoint("client"), bind=False, hwm=0)
    with pytest.raises(RunDirError, match="over the 107-byte limit"):
        make_socket(ctx, zmq.DEALER, "ipc:///tmp/" + "x" * 120, bind=True)


def test_send_refuses_an_unencodable_message(run, ctx):
    s = make_socket(ctx, zmq.DEALER, run.endpoint("client"), bind=False)
    bad = m.ExpertRequest(request_id=1, layer=1, experts=[1], demand=True)
    object.__setattr__(bad, "demand", "yes")  # what a buggy sender could build
    with pytest.raises(ProtocolError, match="ExpertRequest.demand: expected bool, got str"):
        send(s, bad)
    s.close()
