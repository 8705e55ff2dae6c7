"""The executor's expert source over the RAM tier: one batched ExpertRequest per MoE layer step
(chunked to what the arena can hold at once), experts yielded as their slots are granted — hits
first, misses as their reads land — computed from the shared-memory slot in place, and released as
soon as the consumer moves on."""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterator

import zmq

from coli.container.format import RecordLayout
from coli.container.reader import decode_expert_record
from coli.protocol.arena import Arena
from coli.protocol.errors import ProtocolError
from coli.protocol.messages import ExpertFailed, ExpertReady, ExpertRelease, ExpertRequest, SlotRef
from coli.protocol.sockets import recv, send
from coli.stages.ramtier.core import ResidencyTable
from coli.weights import ExpertWeights


class ExpertUnavailable(Exception):
    """The RAM tier could not provide an expert (a failed read or checksum): names layer and expert."""


class RamTierExperts:
    def __init__(self, sock: zmq.Socket, arena: Arena, table: ResidencyTable, layout: RecordLayout,
                 n_experts: int, max_lease: int, idle: Callable[[], None], log=None):
        self.sock, self.arena, self.table, self.layout = sock, arena, table, layout
        self.E = n_experts
        self.max_lease = max(1, max_lease)
        self.idle = idle  # called while waiting: checks control messages and parent death, may raise
        self.log = log
        self._ids = itertools.count(1)
        self.stats = {"expert_requests": 0, "experts_served": 0, "wait_s": 0.0, "stale_grants": 0,
                      "pilot_predicted": 0, "pilot_hits": 0, "prefetch_requests": 0}
        self._queued: list[tuple[int, list[int]]] = []   # pilot predictions not yet sent
        self._predicted: dict[int, set[int]] = {}       # layer -> predicted experts, until it is asked for

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """The pilot's guess of `layer`'s experts: sent to the RAM tier as a prefetch (demand=False; no
        answer comes back, nothing waits on it) right after the next demand request goes out, so the
        layer being computed is asked for first."""
        if ids:
            self._queued.append((layer, list(ids)))
            self._predicted[layer] = set(ids)
            self.stats["pilot_predicted"] += len(ids)

    def _send_prefetches(self) -> None:
        for layer, ids in self._queued:
            send(self.sock, ExpertRequest(next(self._ids), layer, ids, False))
            self.stats["prefetch_requests"] += 1
        self._queued.clear()

    def stream(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        guess = self._predicted.pop(layer, None)
        if guess:
            self.stats["pilot_hits"] += len(guess.intersection(ids))
        if not ids:
            self._send_prefetches()
        for c0 in range(0, len(ids), self.max_lease):
            yield from self._chunk(layer, ids[c0:c0 + self.max_lease])

    def _chunk(self, layer: int, chunk: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        for item in self.grants(layer, chunk):
            if item is None:
                continue
            e, ref = item
            try:
                buf = self.arena.ref_array(ref)
                weights = decode_expert_record(buf, self.layout)
                del buf
                yield e, weights
            finally:
                self.release(ref)

    def grants(self, layer: int, ids: list[int]) -> Iterator[tuple[int, SlotRef] | None]:
        """Leases on the arena slots holding `layer`'s experts `ids`, as (expert, SlotRef), in arrival order
        (RAM hits first, then misses as their reads land), in chunks of at most max_lease; None before a
        wait (the consumer may compute what it holds). The consumer gives each lease back with release()."""
        for c0 in range(0, len(ids), self.max_lease):
            yield from self._grant_chunk(layer, ids[c0:c0 + self.max_lease])

    def _grant_chunk(self, layer: int, chunk: list[int]) -> Iterator[tuple[int, SlotRef] | None]:
        rid = next(self._ids)
        send(self.sock, ExpertRequest(rid, layer, chunk, True))
        self.stats["expert_requests"] += 1
        if self._queued:
            self._send_prefetches()
        remaining = set(chunk)
        while remaining:
            if not self.sock.poll(0):
                yield None
            t0 = time.perf_counter()
            msg = self._next_answer(rid)
            self.stats["wait_s"] += time.perf_counter() - t0
            if isinstance(msg, ExpertFailed):
                raise ExpertUnavailable(f"layer {msg.layer} expert(s) {msg.experts}: {msg.reason}")
            for i, (e, ref) in enumerate(zip(msg.experts, msg.slots)):
                key = layer * self.E + e
                # the slot is leased: its generation cannot move while we hold it
                if not self.table.still_valid(key, ref.slot, ref.generation):
                    for r in msg.slots[i:]:
                        self.release(r)
                    raise ExpertUnavailable(f"slot {ref.slot} of layer {layer} expert {e} was recycled while leased")
                self.stats["experts_served"] += 1
                remaining.discard(e)
                yield e, ref

    def release(self, ref: SlotRef) -> None:
        send(self.sock, ExpertRelease([ref]))

    def _next_answer(self, rid: int):
        while True:
            if self.sock.poll(50):
                try:
                    msg = recv(self.sock, flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except ProtocolError as e:
                    if self.log:
                        self.log.error("protocol_error", error=str(e), peer="ramtier")
                    continue
                if isinstance(msg, (ExpertReady, ExpertFailed)) and msg.request_id == rid:
                    return msg
                if isinstance(msg, ExpertReady):
                    # a grant for an abandoned request (cancelled, failed): give the leases back
                    self.stats["stale_grants"] += 1
                    send(self.sock, ExpertRelease(list(msg.slots)))
                continue
            self.idle()
