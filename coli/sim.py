"""Expert-cache policy simulator: hit rates of replacement policies on a routing trace.

Model (docs/policy.md): every MoE layer has its own cache of `slots` experts (or, with `shared=True`,
one pool of `slots * L` experts for all layers). A token's K experts of a layer are requested together;
a request is a hit if the expert was resident before the token. Misses are loaded into a staging
buffer that is not part of the cache, so after the token the cache may hold any `slots` experts of
(what it held) U (what the token requested): a policy is a ranking of those candidates, and the cache
keeps the top `slots`. Policies that must admit every miss ("forced admission", like a cache that is
filled by its demand copies) rank the token's own experts first.

    lru     last use; ties in one token by routing weight                     (admits every miss)
    lfu     use count over the whole history, ties by recency                 (admits every miss)
    freq    the same ranking as lfu, but a miss is admitted only if it out-counts a resident
            (both: with count_decay < 1 a count decays by that factor per token, so it can follow drift)
    rdf     recency-primary (token of last use), decayed-frequency tie-break:
            f <- f * decay**dt + 1 on use                                      (admits every miss)
    slru    segmented LRU: misses enter probation, a hit promotes to the protected segment
            (`protected` x slots of it), its overflow is demoted to probation's MRU end
    pinlru  the RAM tier's policy: LRU that evicts unpinned experts first (`pins` mask) (admits every miss)
    belady  clairvoyant: keep the candidates whose next use is soonest (admission included), which is
            optimal for this model — the upper bound of every policy above

All layers (rows) advance together, one vectorised step per token: a 75-layer x 1000-token trace runs
a policy in a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

POLICIES = ("lru", "lfu", "freq", "rdf", "slru", "pinlru", "belady")
# The VRAM execution cache's default, chosen by the study in docs/policy.md (best non-clairvoyant policy
# on the glm52 trace at 8 slots per layer and on the demo model's traces at most sizes).
DEFAULT_POLICY = "freq"
ONLINE = ("lru", "lfu", "freq", "rdf", "slru")  # the non-clairvoyant policies of the VRAM study


@dataclass
class SimResult:
    policy: str
    slots: int                 # per layer (the shared pool holds slots * L)
    capacity: int              # experts the cache holds in all
    shared: bool
    hits: int
    requests: int
    layer_hits: np.ndarray = field(repr=False)      # [L]
    layer_requests: np.ndarray = field(repr=False)  # [L]
    hit_mask: np.ndarray | None = field(default=None, repr=False)  # [T, L, K] bool, with record_hits
    params: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy, "slots_per_layer": self.slots, "capacity": self.capacity,
                "shared": self.shared, "hits": self.hits, "requests": self.requests,
                "hit_rate": round(self.hit_rate, 6), **self.params}


def next_use(idx: np.ndarray, shared: bool = False) -> np.ndarray:
    """For every request idx[t, l, k], the step at which the same expert is next requested in the same
    cache (inf-like T*L+1 if never). Per-layer caches count tokens; the shared pool counts (token, layer)
    in execution order t*L + l."""
    T, L, K = idx.shape
    big = T * L + 1
    out = np.full((T, L, K), big, np.int64)
    t = np.broadcast_to(np.arange(T)[:, None, None], idx.shape)
    l = np.broadcast_to(np.arange(L)[None, :, None], idx.shape)
    valid = idx >= 0
    tt, ll, ee = t[valid], l[valid], idx[valid].astype(np.int64)
    when = tt * L + ll if shared else tt
    key = ll * 65536 + ee                              # (layer, expert) identifies a cache entry
    order = np.lexsort((when, key))
    ks, ws = key[order], when[order]
    nxt = np.full(len(order), big, np.int64)
    same = ks[1:] == ks[:-1]
    nxt[:-1][same] = ws[1:][same]
    flat = np.full(len(order), big, np.int64)
    flat[order] = nxt
    out[valid] = flat
    return out


def _within_token_tie(idx: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """A value in [0, 1) per request, higher for the heavier expert of a token: which of a token's own
    experts a policy keeps when it cannot keep all."""
    T, L, K = idx.shape
    if weights is None:
        return np.broadcast_to(np.linspace(0.5, 0.0, K, endpoint=False), idx.shape).astype(np.float64)
    rank = np.argsort(np.argsort(weights, axis=-1, kind="stable"), axis=-1, kind="stable")  # 0 = lightest
    return rank.astype(np.float64) / K


def _top(score: np.ndarray, cap: int) -> np.ndarray:
    """Column indices of the `cap` highest scores of each row of score [R, M] (M > cap)."""
    return np.argpartition(-score, cap - 1, axis=1)[:, :cap]


def simulate(idx: np.ndarray, policy: str, slots: int | None = None, *, weights: np.ndarray | None = None,
             shared: bool = False, capacity: int | None = None, decay: float = 0.9, protected: float = 0.8,
             count_decay: float = 1.0, pins: np.ndarray | None = None, n_experts: int | None = None, warmup: int = 0,
             record_hits: bool = False) -> SimResult:
    """Run one policy over routing idx [T, L, K] (-1 = no request). `slots` per layer, or `capacity` in
    all with shared=True. `pins` [L, E] bool for pinlru. Hits of tokens < warmup are not counted."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    idx = np.asarray(idx)
    T, L, K = idx.shape
    E = int(n_experts if n_experts is not None else max(int(idx.max()) + 1, 1))
    if shared:
        cap = int(capacity if capacity is not None else (slots or 0) * L)
        R = 1
    else:
        if slots is None:
            raise ValueError("give slots (per layer) for per-layer caches")
        cap = int(slots)
        R = L
    if cap < 0:
        raise ValueError("cache size must be >= 0")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1] (got {decay})")
    if not 0.0 < count_decay <= 1.0:
        raise ValueError(f"count_decay must be in (0, 1] (got {count_decay})")
    if not 0.0 <= protected <= 1.0:
        raise ValueError(f"protected must be in [0, 1] (got {protected})")
    if policy == "pinlru" and pins is None:
        raise ValueError("pinlru needs a pins mask [L, E]")
    if idx.size and int(idx.max()) >= E:
        raise ValueError(f"expert id {int(idx.max())} >= n_experts {E}")
    srt = np.sort(idx, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if dup.any():
        t, l, _ = np.argwhere(dup)[0]
        raise ValueError(f"token {t} requests an expert twice in layer {l}: {idx[t, l].tolist()}")

    # State is dense per (layer, expert) entry; the cache contents are a compact [R, cap] table of entry
    # numbers (-1 = empty), so a step ranks only the cap + (requests) candidates of each row.
    valid = idx >= 0
    lidx = np.broadcast_to(np.arange(L)[None, :, None], idx.shape)
    flat = np.where(valid, lidx * E + idx, -1).astype(np.int64)          # [T, L, K] entry numbers
    tie = _within_token_tie(idx, weights)                                  # [T, L, K] in [0, 1)
    if shared:
        tie = (lidx + tie) / L                                             # later layers ran later
    nu = next_use(idx, shared).astype(np.float64) if policy == "belady" else None

    size = L * E
    resident = np.zeros(size, bool)
    table = np.full((R, cap), -1, np.int64)
    req = np.zeros(size, bool)
    last = np.full(size, -1.0)       # step of last use (+ in-token order) for recency
    count = np.zeros(size)           # lfu / freq
    fdec = np.zeros(size)            # rdf decayed frequency as of the last use
    prot = np.zeros(size, bool)      # slru protected segment
    pos = np.full(size, -1.0)        # slru position inside its segment
    nxt = np.full(size, np.inf)      # belady: next use of each entry
    pin = np.asarray(pins, bool).reshape(size) if pins is not None else None
    f_bound = (1.0 / (1.0 - decay)) if decay < 1.0 else float(T + 1)
    p_cap = int(np.floor(cap * protected)) if policy == "slru" else 0
    BIG = 4.0 * (T + 2) ** 2

    layer_hits = np.zeros(L, np.int64)
    layer_req = np.zeros(L, np.int64)
    hit_mask = np.zeros((T, L, K), bool) if record_hits else None

    for t in range(T):
        ft = flat[t]                                       # [L, K]
        v = valid[t]
        f = ft[v]                                          # requested entries
        hm = resident[np.maximum(ft, 0)] & v               # [L, K]
        if t >= warmup:
            layer_hits += hm.sum(axis=1)
            layer_req += v.sum(axis=1)
        if record_hits:
            hit_mask[t] = hm
        if cap == 0:
            continue
        h = hm[v]
        tv = tie[t][v]
        now = t + 0.5 * tv                                 # recency with the in-token order
        new = np.where(hm, -1, ft).reshape(R, -1)          # misses join the candidates
        cand = np.concatenate([table, new], axis=1)        # [R, cap + misses]
        ok = cand >= 0
        c = np.where(ok, cand, 0)

        if policy == "lru":
            last[f] = now
            score = last[c]
        elif policy in ("lfu", "freq"):
            if count_decay < 1.0:
                # counts are stored as of their last use; bring them to now to compare
                count[f] = count[f] * np.power(count_decay, t - np.floor(np.maximum(last[f], 0))) + 1
                last[f] = now
                cnt = count[c] * np.power(count_decay, t - np.floor(np.maximum(last[c], 0)))
                score = cnt * (T + 2) + last[c]
            else:
                last[f] = now
                count[f] += 1
                score = count[c] * (T + 2) + last[c]
            if policy == "lfu":
                req[f] = True
                score = score + BIG * req[c]
                req[f] = False
        elif policy == "rdf":
            prev = last[f]
            age = np.where(prev >= 0, t - np.floor(prev), 0.0)
            fdec[f] = fdec[f] * np.power(decay, age) + 1.0
            last[f] = now
            # token of last use first; entries last used in the same token were updated then, so their
            # decayed frequencies compare as they are; then the in-token order
            lt = last[c]
            tok = np.floor(lt)
            score = tok * 4.0 + 2.0 * (fdec[c] / (f_bound + 1.0)) + 1e-3 * (lt - tok)
        elif policy == "slru":
            prot[f[h]] = True                              # a hit promotes
            prot[f[~h]] = False                            # a miss enters probation
            pos[f] = now
            pc = prot[c] & ok
            if p_cap < cap and int(pc.sum(axis=1).max()) > p_cap:
                ps = np.where(pc, pos[c], -np.inf)
                keep = np.zeros(ps.shape, bool)
                if p_cap > 0:
                    np.put_along_axis(keep, _top(ps, p_cap), True, axis=1)
                demote = c[pc & ~keep]                     # protected overflow -> probation MRU,
                prot[demote] = False                       # behind this token's own misses
                pos[demote] = t - 0.25
            score = prot[c] * BIG + pos[c]
        elif policy == "pinlru":
            last[f] = now
            req[f] = True
            score = pin[c] * BIG + last[c] + 2 * BIG * req[c]
            req[f] = False
        else:  # belady
            nxt[f] = nu[t][v]
            score = -nxt[c]

        score = np.where(ok, score, -np.inf)
        if cand.shape[1] > cap:
            top = _top(score, cap)
            table = np.take_along_axis(cand, top, axis=1)
            table[np.take_along_axis(score, top, axis=1) == -np.inf] = -1
        else:
            table = cand.copy()
        resident[:] = False
        kept = table[table >= 0]
        resident[kept] = True

    params = {}
    if policy == "rdf":
        params["decay"] = decay
    if policy == "slru":
        params["protected"] = protected
    if policy in ("lfu", "freq") and count_decay < 1.0:
        params["count_decay"] = count_decay
    return SimResult(policy, int(slots if slots is not None else cap // max(L, 1)), cap, shared,
                     int(layer_hits.sum()), int(layer_req.sum()), layer_hits, layer_req, hit_mask, params)


def sweep(idx: np.ndarray, policies: Iterable[str], slots_list: Sequence[int], **kw) -> list[SimResult]:
    return [simulate(idx, p, s, **kw) for p in policies for s in slots_list]


def top_used_pins(idx: np.ndarray, n_pins: int, n_experts: int) -> np.ndarray:
    """The RAM tier's learned pin set from a (training) trace: the n most used (layer, expert) keys,
    as `RamTierCore.top_used` picks them from its usage counts. -> [L, E] bool."""
    T, L, K = idx.shape
    counts = np.zeros(L * n_experts, np.int64)
    v = idx >= 0
    keys = (np.broadcast_to(np.arange(L)[None, :, None], idx.shape) * n_experts + idx)[v]
    np.add.at(counts, keys, 1)
    pins = np.zeros(L * n_experts, bool)
    if n_pins > 0:
        order = np.argsort(-counts, kind="stable")[:n_pins]
        pins[order[counts[order] > 0]] = True
    return pins.reshape(L, n_experts)


def miss_stream(idx: np.ndarray, hit_mask: np.ndarray) -> np.ndarray:
    """The requests that missed an upper tier (idx with hits replaced by -1): what the tier below sees."""
    return np.where(hit_mask, -1, idx)


def format_table(results: Sequence[SimResult], title: str = "") -> str:
    """A plain-text table: one row per policy, one column per cache size, hit rates in %."""
    slots = sorted({r.slots for r in results})
    pols = list(dict.fromkeys(r.policy for r in results))
    by = {(r.policy, r.slots): r for r in results}
    head = f"{'policy':<8}" + "".join(f"{s:>8}" for s in slots)
    lines = ([title] if title else []) + [head]
    for p in pols:
        lines.append(f"{p:<8}" + "".join(f"{100 * by[(p, s)].hit_rate:>7.1f}%" if (p, s) in by else f"{'':>8}"
                                         for s in slots))
    return "\n".join(lines)
