"""The compressed KV cache: per layer the normalised latent [T, Lkv] and the rotated rope key
[T, dr] (MLA), plus the indexer key [T, ihd] on layers whose indexer is "full" (reference §3.10).

Storage grows by doubling on the backend; `length` is the number of cached positions. The arrays
are exactly what a session saves to disk (issue 8), so keep them plain.

With a `pool` (coli/model/cache_pool.py: the model's), buffers come from the idle sets of released caches of the
same capacity (the same addresses: replayed decode graphs keyed on them hit), a cache that grows gives its old
buffers back, and `release()` -- by the owner of the cache's lifetime, when nothing uses it any more -- gives the
current ones back. A released cache holds no buffers: any later use raises CacheReleased instead of writing into a
set that another sequence may own by then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coli.config import ModelConfig
from coli.model.backend import Array, Backend
from coli.model.cache_pool import CachePool, bucket


def context_limit(config) -> int:
    """The model's context in positions (0: not known): no cache is sized past it."""
    return int(getattr(config, "max_position_embeddings", 0) or 0)


class CacheReleased(RuntimeError):
    """A KV cache used after `release()` gave its buffers back (a bug of the code that released it)."""


@dataclass
class LayerCache:
    lat: Array        # [cap, Lkv]
    k_pe: Array       # [cap, dr]
    k_idx: Array | None  # [cap, ihd] on "full" indexer layers, None on "shared" ones


@dataclass
class KVCache:
    config: ModelConfig
    backend: Backend
    capacity: int = 0
    length: int = 0
    layers: list[LayerCache] = field(default_factory=list)
    pool: CachePool | None = None      # where its buffers come from and go back to (None: the allocator's only)
    released: bool = False
    reused: bool = False               # its first buffers were a released cache's (from the pool)

    @classmethod
    def empty(cls, config: ModelConfig, backend: Backend, capacity: int = 256,
              pool: CachePool | None = None) -> "KVCache":
        """A cache of at least `capacity` rows; with a pool, exactly bucket(capacity, the model's context) rows, its
        buffers a released cache's of that capacity when the pool has one."""
        c = cls(config, backend, pool=pool)
        c._allocate(bucket(capacity, context_limit(config)) if pool is not None else max(1, capacity))
        return c

    def _allocate(self, capacity: int) -> None:
        c, b = self.config, self.backend
        old, old_capacity = self.layers, self.capacity
        got = self.pool.take(capacity) if self.pool is not None else None
        if not old:
            self.reused = got is not None
        self.layers = []
        for i in range(c.num_hidden_layers):
            lc = got[i] if got is not None else LayerCache(
                b.empty((capacity, c.kv_lora_rank)),
                b.empty((capacity, c.qk_rope_head_dim)),
                b.empty((capacity, c.index_head_dim)) if c.indexer_types[i] == "full" else None,
            )
            if old and self.length:
                b.write_rows(lc.lat, 0, b.rows(old[i].lat, self.length))
                b.write_rows(lc.k_pe, 0, b.rows(old[i].k_pe, self.length))
                if lc.k_idx is not None:
                    b.write_rows(lc.k_idx, 0, b.rows(old[i].k_idx, self.length))
            self.layers.append(lc)
        self.capacity = capacity
        if old and self.pool is not None:
            # grown: the old rows were copied out above (on the GPU: queued on the compute stream, which orders them
            # before any write of the set's next owner, queued on the same stream)
            self.pool.give(old_capacity, old)

    def release(self) -> None:
        """This cache ends: its buffers go back to its pool (or to the allocator without one). Call it where the
        cache's lifetime is owned and nothing uses it any more; releasing twice does nothing."""
        layers, self.layers = self.layers, []
        if layers and self.pool is not None and not self.released:
            self.pool.give(self.capacity, layers)
        self.released, self.length, self.capacity = True, 0, 0

    def _live(self) -> None:
        if self.released:
            raise CacheReleased("this KV cache was released (its buffers went back to the model's cache pool) and "
                                "is used again: the code that released it still had a use for it")

    def reserve(self, new_positions: int) -> None:
        self._live()
        need = self.length + new_positions
        if need > self.capacity:
            cap = self.capacity
            while cap < need:
                cap *= 2
            # the model's context caps the doubling as it caps bucket(): a GLM-5 session cache doubling from 256
            # would reach 262,144 rows for a context of 202,752 (~13 GB of f32 rows that no position can use)
            limit = context_limit(self.config)
            if 0 < limit < cap and need <= limit:
                cap = limit
            self._allocate(cap)

    def write(self, layer: int, start: int, lat: Array, k_pe: Array, k_idx: Array | None) -> None:
        """Store S new positions starting at `start` (= length before this call)."""
        self._live()
        lc, b = self.layers[layer], self.backend
        pairs = [(lc.lat, lat), (lc.k_pe, k_pe)]
        if lc.k_idx is not None and k_idx is not None:
            pairs.append((lc.k_idx, k_idx))
        b.write_rows_many(pairs, start)                # one launch in a captured step (CudaBackend: kv_put3)

    def view(self, layer: int, n: int) -> tuple[Array, Array, Array | None]:
        self._live()
        lc, b = self.layers[layer], self.backend
        return b.rows(lc.lat, n), b.rows(lc.k_pe, n), (b.rows(lc.k_idx, n) if lc.k_idx is not None else None)

    def truncate(self, length: int) -> None:
        """Forget positions >= length (e.g. to re-run a turn)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def host_arrays(self) -> dict[str, np.ndarray]:
        """The cached positions as host float32 arrays, named per layer (for saving sessions)."""
        self._live()
        out: dict[str, np.ndarray] = {}
        b = self.backend
        for i, lc in enumerate(self.layers):
            out[f"{i}.lat"] = np.array(b.to_host(b.rows(lc.lat, self.length)))
            out[f"{i}.k_pe"] = np.array(b.to_host(b.rows(lc.k_pe, self.length)))
            if lc.k_idx is not None:
                out[f"{i}.k_idx"] = np.array(b.to_host(b.rows(lc.k_idx, self.length)))
        return out
