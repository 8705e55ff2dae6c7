"""Who waits for which answers of the RAM tier, for exactly as long as answers are owed.

Pure bookkeeping for the process wrapper (no sockets). Two jobs:

- `AnswerBook`: each demand ExpertRequest gets a tier-internal tag; the core works with tags, and the
  wrapper turns a tag's grants and failures back into (peer, the peer's own request id). The entry is
  dropped with the request's last answer, so the book holds only requests in flight. (It used to be a
  `{request_id: peer}` dict that was never pruned: ~124 B per request, ~9 GB per million GLM-5 tokens.)
  Tags also keep two peers that use the same request id (or a hostile peer replaying the executor's
  ids) from receiving each other's grants.
- `LeaseBook`: which peer holds which leases, so an ExpertRelease only gives back leases its sender
  holds (another peer's release of the executor's slot would let the slot be recycled under it), and
  the leases of a peer that disconnected go back (a peer that took leases and left used to keep those
  slots out of use for the rest of the run: a few such peers stalled it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

PREFETCH_TAG = 0  # prefetches are never answered: the core sees this tag and nothing is booked


@dataclass
class _Asker:
    peer: bytes
    request_id: int
    left: int  # experts of the request not answered yet


class AnswerBook:
    def __init__(self) -> None:
        self._by_tag: dict[int, _Asker] = {}
        self._tags = itertools.count(PREFETCH_TAG + 1)

    def expect(self, peer: bytes, request_id: int, n_answers: int) -> int:
        """A demand request of `n_answers` experts from `peer`: the tag the core should see."""
        tag = next(self._tags)
        self._by_tag[tag] = _Asker(peer, request_id, n_answers)
        return tag

    def answered(self, tag: int, n: int) -> tuple[bytes, int] | None:
        """`n` of the tag's experts were answered now: (peer, its request id), or None for a tag that is
        not booked (a prefetch). The entry goes with the last answer."""
        a = self._by_tag.get(tag)
        if a is None:
            return None
        a.left -= n
        if a.left <= 0:
            del self._by_tag[tag]
        return a.peer, a.request_id

    def owed_to_others(self, peer: bytes) -> int:
        """Experts still owed to every peer but `peer` (each will become a lease when answered)."""
        return sum(a.left for a in self._by_tag.values() if a.peer != peer)

    def drop_peer(self, peer: bytes) -> int:
        """`peer` disconnected: forget its requests (their grants, when reads land, find no asker and are
        given back). Returns how many were dropped."""
        gone = [t for t, a in self._by_tag.items() if a.peer == peer]
        for t in gone:
            del self._by_tag[t]
        return len(gone)

    def __len__(self) -> int:
        return len(self._by_tag)


class LeaseBook:
    def __init__(self) -> None:
        self._held: dict[tuple[bytes, int, int], int] = {}  # (peer, slot, generation) -> leases

    def granted(self, peer: bytes, slot: int, generation: int) -> None:
        k = (peer, slot, generation)
        self._held[k] = self._held.get(k, 0) + 1

    def give_back(self, peer: bytes, slot: int, generation: int) -> bool:
        """True if `peer` held a lease on (slot, generation) and has now given it back."""
        k = (peer, slot, generation)
        n = self._held.get(k, 0)
        if n <= 0:
            return False
        if n == 1:
            del self._held[k]
        else:
            self._held[k] = n - 1
        return True

    def held_by_others(self, peer: bytes) -> int:
        """Leases held by every peer but `peer`."""
        return sum(n for k, n in self._held.items() if k[0] != peer)

    def drop_peer(self, peer: bytes) -> list[tuple[int, int]]:
        """`peer` disconnected: every (slot, generation) lease it held, once per lease, to give back."""
        out = []
        for k in [k for k in self._held if k[0] == peer]:
            out += [(k[1], k[2])] * self._held.pop(k)
        return out

    def __len__(self) -> int:
        return len(self._held)
