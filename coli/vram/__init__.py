"""The GPU's VRAM execution cache (ARCHITECTURE §3-§4). `pool` is its pure core: slot states, pins,
admission and replacement, and the sizing of the pool from the VRAM budget. The CUDA side (device
memory, copy lanes, events) builds on it and keeps no policy of its own."""

from coli.vram.pool import (POOL_POLICIES, PoolStats, SlotPool, describe_pool, size_pool)

__all__ = ["POOL_POLICIES", "PoolStats", "SlotPool", "describe_pool", "size_pool"]
