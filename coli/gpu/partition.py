"""Placing one model on several GPUs of one host (issue 18): a pure planner, no CUDA, no I/O.

Given the model's geometry and each GPU's VRAM budget (and link rate when known), decide

    experts      which GPU owns every routed (MoE layer, expert): by MoE-layer range ("layer") or by expert id
                 within every layer ("expert"); each (layer, expert) has exactly one owner
    dense core   each transformer layer's dense part (attention, indexer, norms, dense MLP or shared expert,
                 router) and its KV cache lives on one "home" GPU: all on one GPU ("whole") or by layer range
                 ("split"); the embedding goes with layer 0, the final norm and lm_head with the last layer
    slot pools   what each GPU's budget leaves after the reserve, its dense share and its KV share, in expert slots
                 (never more than the experts it owns)
    hand-offs    how many times per decoded token the hidden state crosses between GPUs, and by which path
                 (peer access, or a D2H + H2D pair through pinned host memory)

and the copy balance each partition implies, from a routing trace (`idx [T, L, K]`, coli/trace.py) or for
uniform, independent routing (exact: the per-GPU counts of one layer's top-k follow a multivariate
hypergeometric law, enumerated).

Why both partitions: every GPU has its own PCIe link. Under "expert", each layer's top-k is spread over the
GPUs, so the links copy at the same time and a cold token's copy time is the sum over layers of the slowest
GPU's share — close to 1/G of one link's. Under "layer", a layer's experts all cross one link while the others
idle (what a later layer needs is not known before its router runs), so one sequence gains nothing; only G or
more sequences in flight (pipelined) keep every link busy. "expert" pays for it in hand-offs: the hidden state
goes to every other GPU that owns one of the layer's selected experts and a partial sum comes back. The plan
computes both figures; `choose` picks the higher single-sequence ceiling (fewer hand-offs on a near tie).

Bytes are decimal GB (1e9), as `coli plan` counts them. The copy-time figures are bounds: copies only, the
layer's copies must land before it computes, disk and compute not counted."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

GB = 1e9
PARTITIONS = ("layer", "expert")
DENSE_PLACEMENTS = ("auto", "whole", "split")
ACTIVATION_BYTES = 4   # the hidden state crosses as float32 (the backends' activation dtype)
NEAR_TIE = 0.02        # single-sequence ceilings within 2 % count as equal: fewer hand-offs wins
MAX_COMPOSITIONS = 2_000_000


class PartitionError(ValueError):
    """A placement that cannot hold: names the GPU, what its share needs, and what to change."""


@dataclass(frozen=True)
class Geometry:
    """What placement needs of a model. Per-layer tuples have one entry per transformer layer (dense and MoE)."""

    layer_types: tuple[str, ...]        # "dense" | "sparse" (MoE) per transformer layer
    experts_per_layer: int              # E
    experts_per_token: int              # K (top-k)
    record_bytes: int                   # one routed expert's record (one VRAM slot)
    dense_layer_bytes: tuple[int, ...]  # each layer's dense part as the container holds it
    embed_bytes: int                    # embedding table (+ the dense file's header): with layer 0
    lm_head_bytes: int                  # final norm + lm_head: with the last layer
    kv_layer_bytes: tuple[int, ...]     # each layer's KV cache at the planned context
    hidden_size: int
    name: str = ""

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "sparse"]

    @property
    def dense_bytes(self) -> int:
        return sum(self.dense_layer_bytes) + self.embed_bytes + self.lm_head_bytes

    @property
    def kv_bytes(self) -> int:
        return sum(self.kv_layer_bytes)

    @property
    def hidden_bytes(self) -> int:
        return self.hidden_size * ACTIVATION_BYTES

    def validate(self) -> None:
        n = len(self.layer_types)
        if n < 1 or not self.moe_layers:
            raise ValueError(f"model {self.name!r}: {n} layers, {len(self.moe_layers)} MoE: nothing to partition")
        if len(self.dense_layer_bytes) != n or len(self.kv_layer_bytes) != n:
            raise ValueError(f"model {self.name!r}: per-layer byte lists must have {n} entries "
                             f"(got {len(self.dense_layer_bytes)} dense, {len(self.kv_layer_bytes)} KV)")
        if not 1 <= self.experts_per_token <= self.experts_per_layer or self.record_bytes < 1:
            raise ValueError(f"model {self.name!r}: top-{self.experts_per_token} of {self.experts_per_layer} "
                             f"experts of {self.record_bytes} B is not a routed model")


@dataclass(frozen=True)
class GpuBudget:
    index: int                       # CUDA ordinal
    vram_bytes: int                  # what this GPU may use (its --vram-gb)
    link_gbps: float | None = None   # host-to-device GB/s of its own link; None: not known


@dataclass(frozen=True)
class PartitionOptions:
    experts_by: str = "expert"          # "layer" | "expert"
    dense: str = "auto"                 # "auto" | "whole" | "split"
    reserve_bytes: int = int(1 * GB)    # per GPU: CUDA context, workspaces, activations (as `coli plan`)
    peer_access: bool | None = None     # GPU-to-GPU peer access between every pair; None: not known (host path)
    # Host-side cost of one hand-off (assumed from ARCHITECTURE §1: ~5 us per async copy or event issued):
    # peer = one copy + one event; pinned host = D2H + event + H2D + event. To be measured on nvidia-h200-x2.
    peer_crossing_us: float = 10.0
    host_crossing_us: float = 20.0


@dataclass
class PartitionPlan:
    partition: str                   # "layer" | "expert"
    dense: str                       # "whole" | "split" (what "auto" became)
    routing: str                     # "uniform" | "trace (T tokens)"
    model: dict
    gpus: list[dict]                 # per GPU, in --gpus order: its parts sum to its budget
    owner: list[list[int]]           # [MoE layer][expert] -> GPU index (exactly one owner each)
    home: list[int]                  # [transformer layer] -> GPU index of its dense part and KV cache
    per_token: dict
    handoffs: dict
    tokens_per_s: dict
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- pieces ------------------------------------------------------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _shares(gpus: Sequence[GpuBudget]) -> list[float]:
    """Each GPU's fair share of the copies: proportional to its link rate (equal when the rates are not known)."""
    rates = [g.link_gbps for g in gpus]
    if all(r is None for r in rates):
        return [1.0 / len(gpus)] * len(gpus)
    if any(r is None for r in rates):
        missing = next(g.index for g in gpus if g.link_gbps is None)
        raise PartitionError(f"GPU {missing}: its link rate is not known while others are: give --pcie-gbps for "
                             f"every GPU (one value, or one per GPU)")
    total = sum(rates)
    return [r / total for r in rates]


def _split_points(weights: Sequence[float], shares: Sequence[float]) -> list[int]:
    """Cut `weights` (in order) into len(shares) contiguous non-empty runs whose sums follow `shares`.
    Returns the run of every item. Each cut goes where the running sum is nearest its target."""
    n, g = len(weights), len(shares)
    cum = np.concatenate([[0.0], np.cumsum(weights, dtype=np.float64)])
    total = cum[-1]
    run = np.zeros(n, dtype=np.int64)
    start, target = 0, 0.0
    for k in range(g - 1):
        target += shares[k] * total
        lo, hi = start + 1, n - (g - 1 - k)          # leave at least one item for each later run
        cut = lo + int(np.argmin(np.abs(cum[lo:hi + 1] - target)))
        run[cut:] = k + 1
        start = cut
    return run.tolist()


def _largest_remainder(n: int, shares: Sequence[float]) -> list[int]:
    """n items in whole counts following shares, each count >= 1 (n >= len(shares))."""
    raw = [max(1.0, n * s) for s in shares]
    scale = (n - len(shares)) / max(sum(raw) - len(shares), 1e-12)
    want = [1 + (r - 1) * scale for r in raw]
    base = [int(math.floor(w)) for w in want]
    for i in sorted(range(len(want)), key=lambda i: base[i] - want[i])[:n - sum(base)]:
        base[i] += 1
    return base


def _ranges(items: Sequence[int]) -> list[list[int]]:
    """[3, 4, 5, 9] -> [[3, 5], [9, 9]] (inclusive ranges of sorted integers)."""
    out: list[list[int]] = []
    for i in items:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def _compositions(owned: Sequence[int], k: int):
    """Every (n_0, ..., n_{G-1}) with 0 <= n_g <= owned[g] and sum k."""
    if len(owned) == 1:
        if k <= owned[0]:
            yield (k,)
        return
    rest = sum(owned[1:])
    for n in range(max(0, k - rest), min(owned[0], k) + 1):
        for tail in _compositions(owned[1:], k - n):
            yield (n, *tail)


def uniform_layer_stats(owned: Sequence[int], k: int, cost: Sequence[float]) -> tuple[float, list[float]]:
    """One MoE layer under uniform routing (k distinct experts of sum(owned), every k-subset equally likely):
    (E[max_g n_g * cost_g], [P(n_g >= 1)]) — the layer's copy time with the links in parallel, and how often
    each GPU is needed at all. Exact, by enumerating the multivariate hypergeometric law."""
    e = sum(owned)
    if math.comb(k + len(owned) - 1, len(owned) - 1) > MAX_COMPOSITIONS:
        raise PartitionError(f"top-{k} over {len(owned)} GPUs has too many count patterns to enumerate; "
                             f"give a routing trace (--trace) instead")
    total = math.comb(e, k)
    exp_max = sum(math.prod(math.comb(o, n) for o, n in zip(owned, ns)) * max(n * c for n, c in zip(ns, cost))
                  for ns in _compositions(owned, k)) / total
    p_any = [1.0 - math.comb(e - o, k) / total for o in owned]
    return exp_max, p_any


# ---- placement ---------------------------------------------------------------------------------------------------
def _check_inputs(geom: Geometry, gpus: Sequence[GpuBudget], o: PartitionOptions) -> None:
    geom.validate()
    if not gpus:
        raise PartitionError("no GPU to place the model on: give --gpus")
    seen = set()
    for g in gpus:
        if g.index in seen:
            raise PartitionError(f"GPU {g.index} is listed twice (--gpus)")
        seen.add(g.index)
        if g.vram_bytes <= 0:
            raise PartitionError(f"GPU {g.index}: VRAM budget {g.vram_bytes / GB:g} GB must be > 0 (--vram-gb)")
        if g.link_gbps is not None and not (math.isfinite(g.link_gbps) and g.link_gbps > 0):
            raise PartitionError(f"GPU {g.index}: link rate {g.link_gbps} GB/s must be > 0 (--pcie-gbps)")
    if o.experts_by not in PARTITIONS:
        raise PartitionError(f"--partition must be one of {', '.join(PARTITIONS)} or auto, got {o.experts_by!r}")
    if o.dense not in DENSE_PLACEMENTS:
        raise PartitionError(f"--dense-placement must be one of {', '.join(DENSE_PLACEMENTS)}, got {o.dense!r}")
    L, E = len(geom.moe_layers), geom.experts_per_layer
    if o.experts_by == "layer" and L < len(gpus):
        raise PartitionError(f"{len(gpus)} GPUs but the model has {L} MoE layers: partition by expert id "
                             f"(--partition expert) or use fewer GPUs")
    if o.experts_by == "expert" and E < len(gpus):
        raise PartitionError(f"{len(gpus)} GPUs but {E} experts per layer: partition by layer range "
                             f"(--partition layer) or use fewer GPUs")


def _check_trace(geom: Geometry, idx: np.ndarray) -> None:
    L, E, K = len(geom.moe_layers), geom.experts_per_layer, geom.experts_per_token
    if idx.ndim != 3 or idx.shape[1] != L or idx.shape[2] != K:
        raise PartitionError(f"routing trace of shape {tuple(idx.shape)} does not fit the model: want [tokens, {L} "
                             f"MoE layers, top-{K}]")
    if idx.shape[0] == 0:
        raise PartitionError("routing trace has no complete token: record some first (coli run --record-routing)")
    if idx.max() >= E or idx.min() < -1:
        raise PartitionError(f"routing trace has expert ids outside 0..{E - 1}: it is of another model")


def _layer_weights(geom: Geometry, idx: np.ndarray | None) -> np.ndarray:
    """Expected routed experts per token in each MoE layer: K, or the trace's mean (dropped slots excluded)."""
    L, K = len(geom.moe_layers), geom.experts_per_token
    if idx is None:
        return np.full(L, float(K))
    return (idx >= 0).sum(axis=2).mean(axis=0).astype(np.float64)


def assign_experts(geom: Geometry, gpus: Sequence[GpuBudget], experts_by: str,
                   idx: np.ndarray | None = None) -> np.ndarray:
    """owner [L, E] int: the position (in `gpus`) of the GPU that owns each (MoE layer, expert)."""
    L, E, G = len(geom.moe_layers), geom.experts_per_layer, len(gpus)
    shares = _shares(gpus)
    if experts_by == "layer":
        run = _split_points(_layer_weights(geom, idx), shares)
        return np.repeat(np.asarray(run, np.int64)[:, None], E, axis=1)
    owner = np.zeros((L, E), np.int64)
    if idx is None:
        # uniform routing: contiguous id blocks, sized by link share, the same in every layer
        counts = _largest_remainder(E, shares)
        owner[:] = np.repeat(np.arange(G), counts)[None, :]
        return owner
    # from a trace: per layer, the most selected experts first, each to the GPU whose load per unit of share is
    # least after taking it (LPT). +1 per expert so the never-seen ones spread too instead of piling on one GPU.
    for l in range(L):
        ids = idx[:, l][idx[:, l] >= 0]
        freq = np.bincount(ids, minlength=E).astype(np.float64) + 1.0
        load = np.zeros(G)
        for e in sorted(range(E), key=lambda e: (-freq[e], e)):
            g = int(np.argmin((load + freq[e]) / np.asarray(shares)))
            owner[l, e] = g
            load[g] += freq[e]
    return owner


def _room_for_core(g: GpuBudget, o: PartitionOptions, min_slots_bytes: int) -> int:
    return g.vram_bytes - min(o.reserve_bytes, g.vram_bytes) - min_slots_bytes


def place_dense(geom: Geometry, gpus: Sequence[GpuBudget], o: PartitionOptions, owner: np.ndarray,
                experts_by: str) -> tuple[list[int], str]:
    """(home position of every transformer layer, "whole" | "split")."""
    n, G = len(geom.layer_types), len(gpus)
    xb, K = geom.record_bytes, geom.experts_per_token
    biggest = max(range(G), key=lambda i: (gpus[i].vram_bytes, -i))
    core = geom.dense_bytes + geom.kv_bytes
    mode = o.dense
    if mode == "auto":
        if experts_by == "layer":
            mode = "split"   # each layer's attention beside its experts: one hand-off per range boundary
        else:
            owned = int((owner == biggest).sum())
            fits = core + min(2 * K, owned) * xb <= _room_for_core(gpus[biggest], o, 0)
            mode = "whole" if fits or G == 1 else "split"
    if mode == "whole":
        return [biggest] * n, "whole"
    if experts_by == "layer":
        moe = geom.moe_layers
        run = owner[:, 0].tolist()
        home = []
        for i in range(n):
            nxt = next((j for j, m in enumerate(moe) if m >= i), len(moe) - 1)  # a dense layer goes with the next MoE
            home.append(int(run[nxt]))
        return home, "split"
    # by expert id: the dense layers cut into ranges that follow what each GPU has room for
    room = [max(_room_for_core(g, o, min(2 * K, int((owner == i).sum())) * xb), 0) for i, g in enumerate(gpus)]
    if sum(room) <= 0:
        return [biggest] * n, "split"
    w = [d + k for d, k in zip(geom.dense_layer_bytes, geom.kv_layer_bytes)]
    w[0] += geom.embed_bytes
    w[-1] += geom.lm_head_bytes
    if n < G:
        return [biggest] * n, "whole"
    return _split_points(w, [r / sum(room) for r in room]), "split"


def _gpu_shares(geom: Geometry, gpus: Sequence[GpuBudget], o: PartitionOptions, owner: np.ndarray,
                home: list[int]) -> list[dict]:
    xb, K = geom.record_bytes, geom.experts_per_token
    out = []
    for i, g in enumerate(gpus):
        layers = [j for j, h in enumerate(home) if h == i]
        dense = sum(geom.dense_layer_bytes[j] for j in layers) + (geom.embed_bytes if home[0] == i else 0) \
            + (geom.lm_head_bytes if home[-1] == i else 0)
        kv = sum(geom.kv_layer_bytes[j] for j in layers)
        owned = int((owner == i).sum())
        reserve = min(o.reserve_bytes, g.vram_bytes)
        min_slots = min(2 * K, owned)   # one layer's top-k computing while the next layer's land
        room = g.vram_bytes - reserve - dense - kv
        if room < min_slots * xb:
            what = [f"the reserve ({_gb(reserve)})"]
            if layers:
                what.append(f"the dense core of layers {_fmt_ranges(layers)} ({_gb(dense)})")
                what.append(f"their KV cache ({_gb(kv)})")
            what.append(f"{min_slots} expert slots ({_gb(min_slots * xb)})")
            raise PartitionError(
                f"GPU {g.index}: its share needs {_gb(reserve + dense + kv + min_slots * xb)} — "
                + ", ".join(what) + f" — but its budget is {g.vram_bytes / GB:g} GB: raise its --vram-gb, lower "
                f"--context, or " + ("split the dense core over the GPUs (--dense-placement split)"
                                     if len(set(home)) == 1 and len(gpus) > 1 else
                                     "convert with a smaller dense format (--dense int4)"))
        slots = min(room // xb, owned)
        moe_of = [m for m in range(owner.shape[0]) if (owner[m] == i).any()]
        out.append({"index": g.index, "vram_budget": g.vram_bytes, "link_gbps": g.link_gbps, "reserve": reserve,
                    "dense_layers": _ranges(layers), "embedding": home[0] == i, "lm_head": home[-1] == i,
                    "dense_core": dense, "kv_cache": kv, "experts_owned": owned,
                    "moe_layers_owned": _ranges(moe_of), "expert_slots": int(slots),
                    "expert_slot_bytes": int(slots * xb), "free": int(room - slots * xb),
                    "hit_rate_vram_uniform": (slots / owned) if owned else None})
    return out


def _fmt_ranges(items: Sequence[int]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _ranges(items))


# ---- per-token figures ------------------------------------------------------------------------------------------
def _copy_figures(geom: Geometry, gpus: Sequence[GpuBudget], owner: np.ndarray, shares: list[float],
                  miss: list[float], idx: np.ndarray | None) -> dict:
    """Expected per-token: copies per GPU, copy seconds with the links in parallel per layer (cold, and with each
    GPU's pool hit rate), and P(GPU g is needed in MoE layer l) for the hand-offs."""
    L, E, K, G = owner.shape[0], geom.experts_per_layer, geom.experts_per_token, len(gpus)
    xb = geom.record_bytes
    # seconds per expert on each GPU's link; relative units (share of one link) when no rate is known
    rate = [g.link_gbps * GB if g.link_gbps else s * G * GB for g, s in zip(gpus, shares)]
    cost = [xb / r for r in rate]
    cost_warm = [c * m for c, m in zip(cost, miss)]
    copies = np.zeros(G)
    t_cold = t_warm = 0.0
    need = np.zeros((L, G))
    if idx is None:
        cache: dict = {}
        for l in range(L):
            owned = tuple(int((owner[l] == g).sum()) for g in range(G))
            if owned not in cache:
                used = [g for g in range(G) if owned[g]]          # enumerate over the GPUs that own any
                sub = tuple(owned[g] for g in used)
                cold, p_any = uniform_layer_stats(sub, K, [cost[g] for g in used])
                warm, _ = uniform_layer_stats(sub, K, [cost_warm[g] for g in used])
                p = np.zeros(G)
                p[used] = p_any
                cache[owned] = (cold, warm, p)
            cold, warm, p = cache[owned]
            t_cold += cold
            t_warm += warm
            need[l] = p
            copies += K * np.asarray(owned) / E
    else:
        own = np.where(idx >= 0, owner[np.arange(L)[None, :, None], np.maximum(idx, 0)], -1)   # [T, L, K]
        counts = np.stack([(own == g).sum(axis=2) for g in range(G)], axis=2).astype(np.float64)  # [T, L, G]
        t_cold = float((counts * np.asarray(cost)).max(axis=2).sum(axis=1).mean())
        t_warm = float((counts * np.asarray(cost_warm)).max(axis=2).sum(axis=1).mean())
        need = (counts > 0).mean(axis=0)
        copies = counts.sum(axis=1).mean(axis=0)
    return {"copies": copies, "t_cold": t_cold, "t_warm": t_warm, "need": need, "cost": cost, "rate": rate}


def _handoffs(geom: Geometry, gpus: Sequence[GpuBudget], home: list[int], need: np.ndarray,
              o: PartitionOptions) -> dict:
    walk = sum(1 for i in range(1, len(home)) if home[i] != home[i - 1])
    moe = 0.0
    for l, i in enumerate(geom.moe_layers):
        moe += 2.0 * sum(need[l, g] for g in range(len(gpus)) if g != home[i])   # hidden out, partial sum back
    n = walk + moe
    path = "peer" if o.peer_access else "pinned host"
    us = o.peer_crossing_us if o.peer_access else o.host_crossing_us
    return {"layer_boundaries": walk, "expert_round_trips": moe, "crossings": n, "bytes": n * geom.hidden_bytes,
            "bytes_per_crossing": geom.hidden_bytes, "path": path,
            "path_known": o.peer_access is not None, "host_us_per_crossing": us, "host_s": n * us * 1e-6}


def make_partition(geom: Geometry, gpus: Sequence[GpuBudget], o: PartitionOptions = PartitionOptions(),
                   idx: np.ndarray | None = None) -> PartitionPlan:
    """Place `geom` on `gpus` (in --gpus order) with one partition; raises PartitionError naming the GPU whose
    budget cannot hold its share. `idx [T, L, K]` is a routing trace (-1 = dropped); None: uniform routing."""
    _check_inputs(geom, gpus, o)
    if idx is not None:
        idx = np.asarray(idx)
        _check_trace(geom, idx)
    L, E, K = len(geom.moe_layers), geom.experts_per_layer, geom.experts_per_token
    xb = geom.record_bytes
    owner_pos = assign_experts(geom, gpus, o.experts_by, idx)
    home_pos, dense_mode = place_dense(geom, gpus, o, owner_pos, o.experts_by)
    shares_ = _gpu_shares(geom, gpus, o, owner_pos, home_pos)
    shares = _shares(gpus)
    miss = [1.0 - (s["hit_rate_vram_uniform"] or 0.0) for s in shares_]
    f = _copy_figures(geom, gpus, owner_pos, shares, miss, idx)
    for s, c, t in zip(shares_, f["copies"], f["rate"]):
        s["copies_per_token"] = float(c)
        s["bytes_per_token"] = float(c * xb)
        s["copy_s_per_token"] = float(c * xb / t)
    known = all(g.link_gbps for g in gpus)
    routed = float(f["copies"].sum())
    pipelined_s = max(s["copy_s_per_token"] for s in shares_)
    one_gpu_s = routed * f["cost"][0]
    tps = {
        # one sequence: a layer's copies must land before it computes; the GPUs' links work at once within a layer
        "cold_one_sequence": 1.0 / f["t_cold"] if known else None,
        # G or more sequences in flight: every link busy all the time; the busiest link bounds the aggregate
        "cold_pipelined": 1.0 / pipelined_s if known else None,
        # each GPU's pool holding its slots' share of what it owns (uniform hit rate), misses crossing its link
        "expected_one_sequence": (1.0 / f["t_warm"] if f["t_warm"] > 0 else None) if known else None,
        # the first GPU of --gpus alone moving the same routed bytes over its one link
        "one_gpu_cold": 1.0 / one_gpu_s if known else None,
        "speedup_cold_one_sequence": one_gpu_s / f["t_cold"],
        "speedup_cold_pipelined": one_gpu_s / pipelined_s,
    }
    per_token = {"routed_experts": routed, "routed_bytes": routed * xb, "copy_s_cold": f["t_cold"] if known else None,
                 "copy_s_expected": f["t_warm"] if known else None}
    routing = "uniform" if idx is None else f"trace ({idx.shape[0]} tokens)"
    assumptions = [
        ("uniform, independent routing (exact expectation over every top-k pattern)" if idx is None else
         f"routing as in the trace ({idx.shape[0]} tokens; "
         + ("in-sample: the expert ids were balanced on this same trace)" if o.experts_by == "expert" else
            "the layer cuts were placed on this same trace)")) + "; copy time per token = sum over MoE layers of the "
        "slowest GPU's copies of that layer (the links run in parallel within a layer, a layer waits for its copies)",
        "expected: each GPU's hit rate = its slots / the experts it owns (uniform), misses cross its own link; the "
        "RAM tier holds every expert (disk not counted)",
        f"hand-offs: the hidden state crosses as float32 ({geom.hidden_bytes:,} B); "
        + ("peer access between the GPUs" if o.peer_access else
           "through pinned host memory (D2H + H2D)" + ("" if o.peer_access is False else
                                                       ": peer access not known (pass --peer-access yes if it is)"))
        + f"; ~{(o.peer_crossing_us if o.peer_access else o.host_crossing_us):g} us of host time per crossing "
          "(assumed, not measured)",
        f"reserve {o.reserve_bytes / GB:g} GB per GPU; the dense core and KV sizes as `coli plan` computes them",
    ]
    if not known:
        assumptions.append("link rates not known: tokens/s are not given; copy balance in shares of one link")
    idx_of = [g.index for g in gpus]
    return PartitionPlan(
        partition=o.experts_by, dense=dense_mode, routing=routing,
        model={"name": geom.name, "layers": len(geom.layer_types), "moe_layers": L, "experts_per_layer": E,
               "experts_per_token": K, "record_bytes": xb, "dense_bytes": geom.dense_bytes, "kv_bytes": geom.kv_bytes,
               "hidden_size": geom.hidden_size},
        gpus=shares_, owner=[[idx_of[p] for p in row] for row in owner_pos.tolist()],
        home=[idx_of[p] for p in home_pos], per_token=per_token,
        handoffs=_handoffs(geom, gpus, home_pos, f["need"], o), tokens_per_s=tps, assumptions=assumptions)


@dataclass
class Choice:
    chosen: PartitionPlan
    candidates: dict                 # partition -> PartitionPlan or the PartitionError text that refused it
    why: str


def choose(geom: Geometry, gpus: Sequence[GpuBudget], o: PartitionOptions = PartitionOptions(),
           idx: np.ndarray | None = None) -> Choice:
    """Plan both partitions and keep the higher single-sequence cold ceiling (fewer hand-offs on a near tie).
    Raises the refusals joined when neither fits."""
    cands: dict = {}
    for p in PARTITIONS:
        try:
            cands[p] = make_partition(geom, gpus, PartitionOptions(**{**asdict(o), "experts_by": p}), idx)
        except PartitionError as e:
            cands[p] = str(e)
    ok = {p: c for p, c in cands.items() if isinstance(c, PartitionPlan)}
    if not ok:
        raise PartitionError(" | ".join(f"by {p}: {c}" for p, c in cands.items()))
    if len(ok) == 1:
        (p, c), = ok.items()
        other = next(q for q in PARTITIONS if q != p)
        return Choice(c, cands, f"by {other} does not fit: {cands[other]}")
    a, b = ok["layer"], ok["expert"]
    sa, sb = a.tokens_per_s["speedup_cold_one_sequence"], b.tokens_per_s["speedup_cold_one_sequence"]
    if abs(sa - sb) <= NEAR_TIE * max(sa, sb):
        c = min((a, b), key=lambda x: x.handoffs["crossings"])
        return Choice(c, cands, f"cold ceilings within {NEAR_TIE:.0%} ({sa:.2f}x, {sb:.2f}x of one GPU): fewer "
                                f"hand-offs per token ({c.handoffs['crossings']:.1f})")
    c = a if sa > sb else b
    return Choice(c, cands, f"cold ceiling of one sequence {max(sa, sb):.2f}x one GPU's against {min(sa, sb):.2f}x")
