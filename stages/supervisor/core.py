"""The supervisor's pure core: which client request runs next, and who is waiting on what.

Requests are queued per client and served round-robin across clients, so one client sending many
requests cannot starve another; within a client they run in order. Up to `max_batch` requests run at the
executor at once (its continuous batching: stages/executor/scheduler.py); the rest wait here, so which request
joins the batch next — the fairness across clients — is decided here."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pending:
    client: bytes
    request_id: str
    message: Any
    t_submit: float
    t_start: float | None = None
    tokens: int = 0


@dataclass
class RequestBook:
    queues: "OrderedDict[bytes, deque[Pending]]" = field(default_factory=OrderedDict)
    running: dict[str, Pending] = field(default_factory=dict)    # at the executor, by request id
    by_id: dict[str, Pending] = field(default_factory=dict)
    max_batch: int = 1

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {self.max_batch})")

    def submit(self, p: Pending) -> None:
        if p.request_id in self.by_id:
            raise ValueError(f"request id {p.request_id!r} is already in use")
        self.queues.setdefault(p.client, deque()).append(p)
        self.by_id[p.request_id] = p

    @property
    def waiting(self) -> int:
        return len(self.by_id) - len(self.running)

    def next(self) -> Pending | None:
        """Start the next request (round-robin over clients) if fewer than max_batch run."""
        if len(self.running) >= self.max_batch or not self.queues:
            return None
        client, q = next(iter(self.queues.items()))
        p = q.popleft()
        del self.queues[client]
        if q:
            self.queues[client] = q  # to the back of the rotation
        self.running[p.request_id] = p
        return p

    def finish(self, request_id: str) -> Pending | None:
        p = self.by_id.pop(request_id, None)
        if p is not None:
            self.running.pop(request_id, None)
        return p

    def cancel(self, request_id: str) -> tuple[Pending | None, bool]:
        """Drop a queued request, or report that it is the running one. -> (pending, was_running)."""
        p = self.by_id.get(request_id)
        if p is None:
            return None, False
        if request_id in self.running:
            return p, True
        q = self.queues.get(p.client)
        if q is not None:
            q.remove(p)
            if not q:
                del self.queues[p.client]
        del self.by_id[request_id]
        return p, False

    def drop_client(self, client: bytes) -> list[Pending]:
        """A client went away: forget its queued requests; returns them (its running ones are kept so the
        caller can cancel them at the executor)."""
        q = self.queues.pop(client, deque())
        for p in q:
            self.by_id.pop(p.request_id, None)
        return list(q)

    def all_waiting(self) -> list[Pending]:
        out = list(self.running.values())
        for q in self.queues.values():
            out.extend(q)
        return out

    def clear(self) -> list[Pending]:
        out = self.all_waiting()
        self.queues.clear()
        self.by_id.clear()
        self.running.clear()
        return out

    def __len__(self) -> int:
        return len(self.by_id)
