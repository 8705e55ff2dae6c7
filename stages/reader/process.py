"""The reader stage process: serves ReadRequests from the RAM tier by reading expert records from the
container into arena slots on a bounded thread pool, and answers ReadDone when each lands.

Sockets: binds `reader` (ROUTER). Peers: the supervisor (control: Hello/Shutdown, we answer Hello,
Ready) and the RAM tier (ReadRequest -> ReadDone)."""

from __future__ import annotations

import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq

from coli.container.reader import ContainerReader
from coli.protocol.arena import Arena
from coli.protocol.geometry import RecordSpec, RunGeometry
from coli.protocol.handshake import run_identity
from coli.protocol.messages import Hello, ReadDone, ReadRequest, Shutdown
from coli.protocol.rundir import RunDir
from coli.protocol.sockets import make_socket, send
from coli.stages.common import drain_router, greet, send_stats, orphan_cleanup, LogOnce, Ticker, configure_logging, die_with_parent, parent_sentinel
from coli.stages.reader.core import FileTable, RecordError, read_record
from coli.stages.faults import Faults
from coli.stages.ramtier.core import ResidencyTable

STAGE = "reader"
MAX_PENDING_FACTOR = 4  # waiting requests beyond 4x the queue depth are refused (only a flood gets there)


def reader_main(run_name: str, run_base: str, arena_name: str, container_dir: str, threads: int = 4,
                queue_depth: int = 16, log_level: str = "info", table_name: str | None = None,
                control: bytes | None = None) -> None:
    """`table_name`: the RAM tier's residency table; with it a ReadRequest may only fill a slot that is
    loading that very expert (never a published one). `control`: the supervisor's routing identity (a
    per-run secret handed over at spawn); Hello and Shutdown from any other peer are refused."""
    rd = RunDir(run_name, run_base, create=False)
    log = configure_logging(rd.log_path(STAGE), STAGE, log_level)
    die_with_parent()
    faults = Faults.from_env()
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, rd.endpoint(STAGE), bind=True)
    arena = Arena.attach(arena_name)
    root = Path(container_dir).resolve()
    container = ContainerReader(root, cache_dense=False)
    cfg = container.config
    geometry = RunGeometry(cfg.num_hidden_layers, tuple(cfg.moe_layers), cfg.n_routed_experts, arena.n_slots,
                           arena.slot_bytes)
    tarena = Arena.attach(table_name) if table_name else None
    table = (ResidencyTable(tarena.slot_view(0), cfg.num_hidden_layers * cfg.n_routed_experts, arena.n_slots)
             if tarena is not None else None)

    def record_of(layer: int, expert: int) -> RecordSpec:
        loc = container.record_location(layer, expert)
        return RecordSpec(loc.path, loc.offset, loc.length, loc.xxh64)

    ramtier = run_identity("ramtier", control) if control is not None else None

    def refusal(req: ReadRequest, peer: bytes | None = None) -> str | None:
        """Why this run cannot serve `req` (naming the field), checked before any byte moves. Even a request
        right in every field is served for the run's RAM tier alone: another peer's duplicate read of a
        loading slot could land after the slot was recycled for another expert."""
        # `file` must be the index's own resolved path, byte for byte (what the RAM tier sends)
        why = geometry.read_request_problem(req.layer, req.expert, req.slot, req.file, req.offset, req.length,
                                            req.checksum, record_of)
        if why or table is None:
            return why
        key = req.layer * cfg.n_routed_experts + req.expert
        if int(table.slot_of[key]) != req.slot or int(table.key_of[req.slot]) != -1:
            return (f"field 'slot': slot {req.slot} is not being loaded with layer {req.layer} expert {req.expert} "
                    f"(a published slot is never overwritten)")
        if ramtier is not None and peer is not None and peer != ramtier:
            return "ReadRequests are served for the run's RAM tier only"
        return None
    files = FileTable()
    once = LogOnce(log)
    done_q: "queue.Queue[tuple[bytes, ReadDone, int, float]]" = queue.Queue()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="read")
    inflight = 0
    stats = {"records": 0, "bytes": 0, "errors": 0, "checksum_failures": 0, "busy_s": 0.0, "queue_depth": 0,
             "threads": threads, "direct_fallbacks": 0, "refused": 0}
    t_start = time.time()

    def work(peer: bytes, req: ReadRequest) -> None:
        t0 = time.perf_counter()
        ok, err, n = True, None, 0
        try:
            why = refusal(req, peer)
            if why:
                raise RecordError(f"ReadRequest refused: {why}")
            path = req.file  # checked above: exactly the index's path of this record
            gen = int(table.gen[req.slot]) if table is not None else 0
            view = arena.slot_view(req.slot)
            n = read_record(files, str(path), req.offset, req.length, req.checksum, view, verify=True)
            if faults.hit("read_error"):
                raise RecordError(f"{path} @ {req.offset}: injected read error (COLI_INJECT)")
            if faults.hit("checksum"):
                raise RecordError(f"{path} @ {req.offset}: injected checksum mismatch (COLI_INJECT)")
            if table is not None and int(table.gen[req.slot]) != gen:
                raise RecordError(f"{path} @ {req.offset}: slot {req.slot} was reassigned during the read")
        except (RecordError, OSError, ValueError) as e:
            ok, err = False, str(e)
        except Exception as e:  # every request is answered, whatever went wrong: a lost answer wedges the pool
            ok, err = False, f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t0
        done_q.put((peer, ReadDone(req.request_id, req.layer, req.expert, req.slot, ok, err), n, dt))
        os.write(wake_w, b"x")

    def _answer(peer: bytes, msg: ReadDone) -> None:
        try:
            send(sock, msg, peer=peer, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone, or a peer that stopped reading: never block the reader on it
            once("completion_undeliverable", error=str(e))

    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    ps = parent_sentinel()
    if ps is not None:
        poller.register(ps, zmq.POLLIN)
    supervisor: bytes | None = None
    ticker = Ticker(0.5)
    pending: list[tuple[bytes, ReadRequest]] = []  # beyond queue_depth: wait here, not in the pool
    log.info("started", container=str(root), threads=threads, queue_depth=queue_depth, arena=arena_name)
    running = True
    try:
        while running:
            events = dict(poller.poll(ticker.timeout_ms() + 1))
            if ps is not None and ps in events:
                log.warning("supervisor is gone; exiting")
                orphan_cleanup(arena_name)
                break
            if wake_r in events:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                while True:
                    try:
                        peer, msg, n, dt = done_q.get_nowait()
                    except queue.Empty:
                        break
                    inflight -= 1
                    stats["busy_s"] += dt
                    if msg.ok:
                        stats["records"] += 1
                        stats["bytes"] += n
                    else:
                        stats["errors"] += 1
                        if "checksum" in (msg.error or ""):
                            stats["checksum_failures"] += 1
                        once("read_failed", error=msg.error)
                    _answer(peer, msg)
            while pending and inflight < queue_depth:
                peer, req = pending.pop(0)
                inflight += 1
                pool.submit(work, peer, req)
            if sock in events:
                for peer, msg in drain_router(sock, log):
                    if isinstance(msg, ReadRequest):
                        why = refusal(msg, peer)
                        if why:  # answered at once: a bad request never takes a place in the queue
                            stats["refused"] += 1
                            once("read_request_refused", error=why, peer=repr(peer))
                            _answer(peer, ReadDone(msg.request_id, msg.layer, msg.expert, msg.slot, False,
                                                   f"ReadRequest refused: {why}"))
                        elif len(pending) >= MAX_PENDING_FACTOR * queue_depth:
                            stats["refused"] += 1
                            _answer(peer, ReadDone(msg.request_id, msg.layer, msg.expert, msg.slot, False,
                                                   f"reader queue full ({len(pending)} waiting; the RAM tier "
                                                   f"keeps at most {queue_depth} in flight)"))
                        elif inflight < queue_depth:
                            inflight += 1
                            pool.submit(work, peer, msg)
                        else:
                            pending.append((peer, msg))
                    elif isinstance(msg, Hello):
                        if greet(sock, peer, msg, STAGE, {"threads": threads, "queue_depth": queue_depth}, log,
                                 control=control):
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
                stats["queue_depth"] = inflight + len(pending)
                stats["direct_fallbacks"] = len(files.fallbacks)
                stats["uptime_s"] = time.time() - t_start
                send_stats(sock, supervisor, STAGE, dict(stats))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        files.close()
        container.close()
        sock.close(linger=0)
        ctx.term()
        del table
        for a in (tarena, arena):
            if a is None:
                continue
            try:
                a.close()
            except Exception as e:  # views still referenced by finished futures: the mapping goes with the process
                log.warning("arena_close", error=str(e))
        log.info("stopped", records=stats["records"], bytes=stats["bytes"])
