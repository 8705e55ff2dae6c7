"""The RAM-tier stage process: owns the arena's expert slots (RamTierCore), answers the executor's
batched ExpertRequests in two phases (hits at once, misses when the reader lands them), orders reads
from the reader (demand before prefetch), and persists per-expert usage for the learned pin set.

Sockets: binds `ramtier` (ROUTER; peers: supervisor control, executor data plane); connects a DEALER to
`reader`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from coli.container.reader import ContainerReader
from coli.protocol.arena import Arena
from coli.protocol.codec import decode
from coli.protocol.errors import ProtocolError
from coli.protocol.geometry import RunGeometry
from coli.protocol.handshake import make_hello, run_identity
from coli.protocol.messages import (ExpertFailed, ExpertReady, ExpertRelease, ExpertRequest, Hello, ReadDone,
                                    ReadRequest, Shutdown, SlotRef)
from coli.protocol.rundir import RunDir
from coli.protocol.sockets import make_socket, recv, send
from coli.stages.common import greet, send_stats, orphan_cleanup, LogOnce, Ticker, configure_logging, die_with_parent, parent_sentinel
from coli.stages.ramtier.answers import PREFETCH_TAG, AnswerBook, LeaseBook
from coli.stages.ramtier.core import Actions, RamTierCore, ResidencyTable
from coli.stages.tmpfiles import sweep_dead_temps, write_private

STAGE = "ramtier"
FOREIGN_LEASE_FRACTION = 0.5  # of the slots, at most, leased to peers other than the run's executor
USAGE_FILE = "coli-usage.json"  # in the container directory: per-expert demand counts across runs


def load_usage(container_dir: Path, n_keys: int) -> np.ndarray:
    p = container_dir / USAGE_FILE
    sweep_dead_temps(container_dir, r"coli-usage\.tmp(\d+)")     # left by a RAM tier killed mid-save
    try:
        d = json.loads(p.read_text())
        arr = np.asarray(d["counts"], dtype=np.int64)
        if arr.shape == (n_keys,):
            return arr
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return np.zeros(n_keys, dtype=np.int64)


def save_usage(container_dir: Path, counts: np.ndarray) -> None:
    """Atomic write; a read-only container directory just means pins are not learned (logged by caller)."""
    p = container_dir / USAGE_FILE
    text = json.dumps({"version": 1, "counts": counts.tolist()})
    write_private(p, lambda tmp: tmp.write_text(text), prefix="coli-usage.tmp")   # temp removed on failure


def pin_set(counts: np.ndarray, n_pins: int) -> list[int]:
    if n_pins <= 0:
        return []
    order = np.argsort(-counts, kind="stable")[:n_pins]
    return [int(k) for k in order if counts[k] > 0]


def ramtier_main(run_name: str, run_base: str, arena_name: str, table_name: str, container_dir: str,
                 pin_fraction: float = 0.25, max_inflight_reads: int = 16, log_level: str = "info",
                 control: bytes | None = None) -> None:
    """`control`: the supervisor's routing identity (a per-run secret handed over at spawn); Hello and
    Shutdown from any other peer are refused. None accepts any peer that says it is the supervisor."""
    rd = RunDir(run_name, run_base, create=False)
    log = configure_logging(rd.log_path(STAGE), STAGE, log_level)
    die_with_parent()
    cdir = Path(container_dir)
    container = ContainerReader(cdir, cache_dense=False)
    cfg = container.config
    E = cfg.n_routed_experts
    n_keys = cfg.num_hidden_layers * E
    arena = Arena.attach(arena_name)
    tarena = Arena.attach(table_name)
    table = ResidencyTable(tarena.slot_view(0), n_keys, arena.n_slots)
    usage = load_usage(cdir, n_keys)
    n_pins = int(arena.n_slots * pin_fraction)
    pins = pin_set(usage, n_pins)
    core = RamTierCore(arena.n_slots, n_keys, table, pinned=pins, max_inflight_reads=max_inflight_reads)
    core.usage += usage
    record_len = container.record_layout.nbytes

    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, rd.endpoint(STAGE), bind=True)
    # A peer that goes away holding leases must give them back (no slot may stay out of use for the run).
    # ROUTER_NOTIFY is draft API, absent from pyzmq's wheels: the socket monitor's DISCONNECTED event names
    # the connection's fd, and each message's SRCFD says which fd its peer came on.
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    peer_fd: dict[bytes, int] = {}  # peers seen -> the fd of their connection; pruned at disconnect
    # The executor (its identity carries the run's secret) can always get half the slots or more: other
    # peers together hold at most the rest, so none of them can stall the run by hoarding leases.
    executor = run_identity("executor", control) if control is not None else None
    foreign_cap = max(1, int(arena.n_slots * FOREIGN_LEASE_FRACTION))
    reader = make_socket(ctx, zmq.DEALER, rd.endpoint("reader"), bind=False, identity=run_identity(STAGE, control))
    send(reader, make_hello(STAGE))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(reader, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    ps = parent_sentinel()
    if ps is not None:
        poller.register(ps, zmq.POLLIN)
    geometry = RunGeometry(cfg.num_hidden_layers, tuple(cfg.moe_layers), E, arena.n_slots, arena.slot_bytes)
    answers = AnswerBook()  # demand requests in flight: tag -> (peer, its request id, answers owed)
    leases = LeaseBook()    # who holds which slot leases: only the holder may give one back
    refused = LogOnce(log)
    supervisor: bytes | None = None
    ticker = Ticker(0.5)
    t_start = time.time()
    read_bytes = 0
    log.info("started", slots=arena.n_slots, slot_bytes=arena.slot_bytes, pins=len(pins), keys=n_keys)

    def carry_out(act: Actions) -> None:
        nonlocal read_bytes
        by_req: dict[int, list] = {}
        for g in act.grants:
            by_req.setdefault(g.request_id, []).append(g)
        for tag, grants in by_req.items():
            asker = answers.answered(tag, len(grants))
            if asker is None:  # cannot happen (prefetches are never granted); give the leases back
                for g in grants:
                    carry_out(core.release(g.slot, g.gen))
                continue
            peer, rid = asker
            for g in grants:
                leases.granted(peer, g.slot, g.gen)
            msg = ExpertReady(rid, grants[0].key // E, [g.key % E for g in grants],
                              [SlotRef(arena_name, g.slot, 0, record_len, g.gen) for g in grants])
            _send_to(peer, msg)
        fails: dict[tuple[int, str], list] = {}
        for f in act.failures:
            fails.setdefault((f.request_id, f.reason), []).append(f.key)
        for (tag, reason), keys in fails.items():
            asker = answers.answered(tag, len(keys))
            if asker is not None:
                _send_to(asker[0], ExpertFailed(asker[1], keys[0] // E, [k % E for k in keys], reason))
        for r in act.reads:
            layer, e = divmod(r.key, E)
            loc = container.record_location(layer, e)
            read_bytes += loc.length
            send(reader, ReadRequest(r.key, layer, e, r.slot, loc.path, loc.offset, loc.length, loc.xxh64))

    def _send_to(peer: bytes | None, msg) -> None:
        if peer is None:
            return
        try:
            send(sock, msg, peer=peer)
        except zmq.ZMQError as e:
            log.warning("answer_undeliverable", error=str(e))
            if isinstance(msg, ExpertReady):  # nobody will release these: the peer is gone
                for ref in msg.slots:
                    if leases.give_back(peer, ref.slot, ref.generation):
                        carry_out(core.release(ref.slot, ref.generation))

    def peer_gone(peer: bytes) -> None:
        held = leases.drop_peer(peer)
        dropped = answers.drop_peer(peer)
        if held or dropped:
            log.info("peer_gone", peer=repr(peer), leases_returned=len(held), requests_dropped=dropped)
        for slot, gen in held:
            carry_out(core.release(slot, gen))

    def drain():
        """drain_router, noting which connection (fd) each peer talks on."""
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes
            peer_fd[peer] = frames[0].get(zmq.SRCFD)
            try:
                yield peer, decode([f.bytes for f in frames[1:]])
            except ProtocolError as e:
                log.error("protocol_error", error=f"from peer {peer!r}: {e}", peer=repr(peer))

    def disconnects() -> None:
        """Connections that closed: their peers' leases go back. An fd is reused only after its close, so
        the executor's and the supervisor's (connected for the whole run) are never mistaken; at worst a
        foreign peer that reconnected on a just-closed fd before its event was read loses its leases."""
        while monitor.poll(0):
            ev = recv_monitor_message(monitor)
            if ev["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for peer in [p for p, fd in peer_fd.items() if fd == ev["value"]]:
                del peer_fd[peer]
                peer_gone(peer)

    running = True
    try:
        while running:
            events = dict(poller.poll(ticker.timeout_ms() + 1))
            if ps is not None and ps in events:
                log.warning("supervisor is gone; exiting")
                orphan_cleanup(arena_name, table_name)
                break
            if reader in events:
                while True:
                    try:
                        msg = recv(reader, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ProtocolError as e:
                        log.error("protocol_error", error=str(e), peer="reader")
                        continue
                    if isinstance(msg, ReadDone):
                        if not msg.ok:
                            log.warning("read_failed", layer=msg.layer, expert=msg.expert, error=msg.error)
                        carry_out(core.read_done(msg.request_id, msg.slot, msg.ok, msg.error or "read failed"))
            if monitor in events:
                disconnects()
            if sock in events:
                for peer, msg in drain():
                    if isinstance(msg, ExpertRequest):
                        why = geometry.expert_request_problem(msg.layer, msg.experts)
                        if why:
                            refused("expert_request_refused", error=why, peer=repr(peer))
                            if msg.demand:
                                _send_to(peer, ExpertFailed(msg.request_id, msg.layer, msg.experts, why))
                            continue
                        if executor is not None and peer != executor and not msg.demand:
                            # only the executor's pilot prefetches; another peer's would only evict and read
                            refused("prefetch_refused", peer=repr(peer),
                                    error="a prefetch (demand=False) is taken only from the run's executor")
                            continue
                        if executor is not None and peer != executor and msg.demand:
                            held = leases.held_by_others(executor) + answers.owed_to_others(executor)
                            if held + len(msg.experts) > foreign_cap:
                                why = (f"field 'experts': {len(msg.experts)} more leases would give peers other than "
                                       f"the run's executor {held + len(msg.experts)} of {arena.n_slots} slots "
                                       f"(at most {foreign_cap})")
                                refused("expert_request_refused", error=why, peer=repr(peer))
                                _send_to(peer, ExpertFailed(msg.request_id, msg.layer, msg.experts, why))
                                continue
                        tag = answers.expect(peer, msg.request_id, len(msg.experts)) if msg.demand else PREFETCH_TAG
                        keys = [msg.layer * E + e for e in msg.experts]
                        carry_out(core.request(tag, keys, msg.demand))
                    elif isinstance(msg, ExpertRelease):
                        act = Actions()
                        for ref in msg.refs:
                            if ref.arena == arena_name and leases.give_back(peer, ref.slot, ref.generation):
                                act.extend(core.release(ref.slot, ref.generation))
                            else:
                                refused("release_refused", peer=repr(peer),
                                        error=f"field 'refs': slot {ref.slot} generation {ref.generation} of arena "
                                              f"{ref.arena!r} is not leased to this peer")
                        carry_out(act)
                    elif isinstance(msg, Hello):
                        info = {"slots": arena.n_slots, "slot_bytes": arena.slot_bytes, "pins": len(pins)}
                        if greet(sock, peer, msg, STAGE, info, log, control=control):
                            supervisor = peer
                    elif isinstance(msg, Shutdown):
                        if control is not None and peer != control:
                            log.error("protocol_error", peer=repr(peer),
                                      error="Shutdown refused: control messages are accepted only from the supervisor")
                            continue
                        log.info("shutdown", reason=msg.reason)
                        running = False
                    else:
                        log.error("protocol_error", error=f"unexpected {type(msg).__name__}", peer=repr(peer))
            if ticker.due() and supervisor is not None:
                c = core.counters.as_dict()
                demand = c["hits"] + c["misses"]
                c.update(resident=core.resident_count(), slots=arena.n_slots, pins=len(pins),
                         resident_bytes=core.resident_count() * record_len, read_bytes=read_bytes,
                         hit_rate=(c["hits"] / demand) if demand else 0.0, uptime_s=time.time() - t_start,
                         requests_in_flight=len(answers), leases_held=len(leases))
                send_stats(sock, supervisor, STAGE, c)
    finally:
        try:
            save_usage(cdir, core.usage)
        except OSError as e:
            log.warning("usage_not_saved", error=str(e), note="the pin set is not learned for read-only containers")
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        reader.close(linger=0)
        ctx.term()
        final = core.counters.as_dict()
        del core, table  # the residency table's numpy views must go before the arena unmaps
        for a in (tarena, arena):
            try:
                a.close()
            except Exception as e:
                log.warning("arena_close", error=str(e))
        container.close()
        log.info("stopped", **final)
