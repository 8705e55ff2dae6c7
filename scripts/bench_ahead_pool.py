"""The host-side (Python) cost of layer-ahead prefill copies in the VRAM slot pool (coli/gpu/pool.py, pure: no GPU):
long prefill steps that ask for every expert of their layer through a full, retaining pool made as VramExperts makes
it, with and without the next layer's experts acquired speculatively after each step (coli/gpu/layer_ahead.py).
Prints, per layer, the demand step's pool time (lookups, acquires: on the path from the router to the first copy)
and the ahead acquires' (after the step's last batch is launched). Usage:

    python scripts/bench_ahead_pool.py [--slots 520] [--experts 256] [--top-k 8] [--layers 6] [--policy freq]
"""

from __future__ import annotations

import argparse
import time

from coli.gpu.pool import SlotPool, staging_slots


def run(n_slots: int, E: int, K: int, L: int, policy: str, ahead: bool) -> tuple[float, float, int]:
    """Two passes over L layers (the first fills the pool); -> (demand s per layer, ahead s per layer, ahead copies)
    over the second pass."""
    pool = SlotPool(n_slots, 1, policy, n_keys=L * E, staging=staging_slots(n_slots, K), spec_displaces=True)
    demand_s = ahead_s = 0.0
    copies = 0
    for rep in range(2):
        for m in range(L):
            pool.begin_step()
            held = []
            t = time.perf_counter()
            for e in range(E):
                key = m * E + e
                s = pool.lookup(key)
                if s is None:
                    s = pool.acquire(key)
                    if s is None:                      # FLUSH: the held batch launched, one retry
                        for h in held:
                            pool.release(h)
                        held = []
                        s = pool.acquire(key, retry=True)
                    if s is None:
                        continue
                    pool.loaded(s)
                held.append(s)
            td = time.perf_counter() - t
            for h in held:
                pool.release(h)
            t = time.perf_counter()
            n = 0
            if ahead and m + 1 < L:
                for e in range(E):
                    key = (m + 1) * E + e
                    if pool.slot_of(key) is None:
                        s = pool.acquire(key, speculative=True)
                        if s is not None:
                            n += 1
                            pool.loaded(s)
                            pool.release(s)
            ta = time.perf_counter() - t
            if rep == 1:
                demand_s, ahead_s, copies = demand_s + td, ahead_s + ta, copies + n
    return demand_s / L, ahead_s / L, copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=520)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--policy", default="freq")
    a = ap.parse_args()
    for ahead in (False, True):
        d, s, n = run(a.slots, a.experts, a.top_k, a.layers, a.policy, ahead)
        print(f"{'ahead' if ahead else 'plain'}: demand {d * 1e3:.1f} ms/layer, ahead acquires {s * 1e3:.1f} ms/layer "
              f"({n} copies), total {(d + s) * 1e3:.1f} ms/layer")


if __name__ == "__main__":
    main()
