"""MTP speculative decoding with GLM-5's own draft head (the MTP layer, reference §4), lossless.

The MTP layer (index L = num_hidden_layers) predicts the token after next. At position i it combines the main
model's final-normed hidden state h_i with the embedding of the token at i+1, in the DeepSeek-V3 layout that vLLM
(`vllm/model_executor/models/deepseek_mtp.py`) and SGLang (`srt/models/deepseek_nextn.py`) implement:

    x   = eh_proj(concat[enorm(embed(t_{i+1})), hnorm(h_i)])        # [S, 2H] -> [S, H]; embedding first
    x   = decoder layer L (MLA + full DSA indexer + MoE) over x      # its own KV cache, position i
    g_i = shared_head.norm(x)                                        # [S, H]
    q   = lm_head(g_i)                                               # the shared lm_head: logits for t_{i+2}

h_i is the main model's output *after* its final norm (vLLM's DeepseekV2Model.forward returns `self.norm(...)`
and the proposer feeds that to the MTP layer). For drafts 2..k the layer is chained on its own output g (SGLang
feeds its shared_head-normed output back; vLLM the un-normed one: we follow SGLang, matching the main model's
normed h). vLLM also zeroes the embedding at position 0; we do not (it only touches the first cached position).

One decoding round, from P processed positions and the sampled token `last` at position P:

    draft   MTP over the pending pairs (h_j, t_{j+1}) its cache lacks, then k-1 chained single steps -> d_1..d_k
    verify  main forward([last, d_1..d_k]) at positions P..P+k, all logits (one multi-token step)
    accept  greedy: the longest prefix with d_j == argmax(row j-1), plus the bonus argmax(row a);
            sampling: d_j kept with probability min(1, p_j(d_j) / q_j(d_j)), the first rejection resampled from
            norm(max(p_j - q_j, 0)); all kept: the bonus from row k — the output distribution is the target's
    rollback main cache -> P + a + 1 positions, MTP cache -> P (its draft positions used draft hiddens)

so greedy output equals decoding without MTP by construction, and a round costs one main step of k+1 positions.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from coli.errors import ColiError
from coli.model.backend import Array, cos_sin_table
from coli.model.forward import GlmMoeDsaModel, LayerWeights, WeightExperts, load_layer_weights
from coli.model.cache_pool import CachePool
from coli.model.kv_cache import KVCache
from coli.model.sampling import Sampler
from coli.model.tensors import mtp_layer

MAX_DRAFTS = 3


class MtpUnavailable(ColiError):
    """`--mtp` asked of a model without a (complete) MTP layer."""


def parse_mtp(value: str | int | None) -> int | str | None:
    """`--mtp off|on|N|auto` -> None (off), a draft count 1..3, or "auto". `on` is 1 draft (the depth the layer
    was trained for); N chains the layer N times."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v in ("off", "0", "none", "false", "no"):
        return None
    if v in ("on", "true", "yes"):
        return 1
    if v == "auto":
        return "auto"
    if v.isdigit() and 1 <= int(v) <= MAX_DRAFTS:
        return int(v)
    raise ColiError(f"--mtp {value!r} is not off, on, auto or a draft count 1..{MAX_DRAFTS}")


def mtp_mode(value: str | int | None) -> str:
    """`--mtp` checked and spelled canonically for the stages and the wire (protocol MTP_MODES): "off", "on",
    "auto" or "1".."3"."""
    k = parse_mtp(value)
    if k is None:
        return "off"
    if k == "auto":
        return "auto"
    return "on" if str(value).strip().lower() in ("on", "true", "yes") else str(k)


def _matrix(backend, host: np.ndarray) -> Array:
    """A host float32 matrix as a backend weight (the CUDA backend wraps it in its weight type)."""
    make = getattr(backend, "matrix", None)
    return make(np.ascontiguousarray(host, np.float32)) if make is not None else backend.upload(host)


@dataclass
class MtpWeights:
    enorm: Array        # [H]
    hnorm: Array        # [H]
    eh_emb: Array       # [H, H]  eh_proj columns that multiply enorm(embedding)
    eh_hid: Array       # [H, H]  eh_proj columns that multiply hnorm(h)
    layer: LayerWeights
    head_norm: Array    # [H]     shared_head.norm


class MtpHead:
    """The MTP layer on the model's backend; the embedding and lm_head are the main model's."""

    def __init__(self, model: GlmMoeDsaModel, weights: Any, experts: Any = None):
        c, b = model.config, model.backend
        L = mtp_layer(c)
        if getattr(weights, "mtp_layer", None) != L:
            why = getattr(weights, "mtp_problem", None) or "it has no MTP layer (the checkpoint had none, or it was " \
                                                             "converted with --no-mtp)"
            where = getattr(weights, "dir", "the model")
            raise MtpUnavailable(f"--mtp: {where} cannot draft: {why}; run with --mtp off, or convert a checkpoint "
                                 f"that has its MTP layer (model.layers.{L}.*)")
        self.model, self.layer_index = model, L
        p = f"model.layers.{L}."
        eh = weights.dense(p + "eh_proj.weight")                                   # [H, 2H]
        H = c.hidden_size
        self.w = MtpWeights(
            enorm=b.upload(weights.dense(p + "enorm.weight")),
            hnorm=b.upload(weights.dense(p + "hnorm.weight")),
            eh_emb=_matrix(b, eh[:, :H]), eh_hid=_matrix(b, eh[:, H:]),
            layer=load_layer_weights(c, weights, b, L, indexer="full", mlp="sparse"),
            head_norm=b.upload(weights.dense(p + "shared_head.norm.weight")),
        )
        # the MTP layer's own cache: one layer, always a full indexer
        self.cache_config = dataclasses.replace(c, num_hidden_layers=1, indexer_types=("full",),
                                                mlp_layer_types=("sparse",))
        self.experts = experts if experts is not None else WeightExperts(weights)
        # greedy k = 1 rounds in their fixed shape (row_round): the CUDA backend replays them from graphs
        # (coli/gpu/mtp_graphs.py); None: rounds run as verify step + catch-up (SpeculativeDecoder.begin_round)
        make = getattr(b, "mtp_round_graphs", None)
        self.rounds = make(self) if make is not None else None
        # greedy verify steps of k + 1 positions (rounds of 2-3 drafts, or of one where `rounds` is off) replayed from
        # graphs (coli/gpu/verify_graphs.py; COLI_VERIFY_GRAPHS=0 turns them off); None: forward_hidden, eagerly
        make = getattr(b, "verify_graphs", None)
        self.verify = make(model) if make is not None else None
        self.cache_pool = CachePool()       # the MTP caches' own (their layout is one layer: not the model's pool)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache.empty(self.cache_config, self.model.backend, capacity, pool=self.cache_pool)

    def step(self, ids: Sequence[int], h: Array, cache: KVCache) -> tuple[Array, Array]:
        """S MTP positions after the cache's: ids [S] are the tokens one ahead of the hidden states h [S, H].
        -> (g [S, H] the normed output, for chaining; logits [S, V] of the token two ahead), on the backend."""
        m, c, b, w = self.model, self.model.config, self.model.backend, self.w
        ids = np.asarray(ids, dtype=np.int64)
        S = int(ids.shape[0])
        x, xn = self._combine(ids, h)                                              # = eh_proj(concat[e, hh]), normed
        start = cache.length
        cache.reserve(S)
        positions = np.arange(start, start + S)
        cos, sin = cos_sin_table(positions, c.qk_rope_head_dim, c.rope_theta)
        lw = w.layer
        a, _ = m._attention(0, lw.attn, xn, positions, cos, sin, cache, start, None)   # cache layer 0 = the MTP layer
        cache.length = start + S
        return self._finish(x, a)

    def step_rows(self, ids: Sequence[int], h: Array, cache: KVCache) -> tuple[Array, Array]:
        """step() with the S positions as S one-position rows, each position's attention its own decode step's
        (coli.model.batch.forward_rows): the fixed shape a CUDA graph replays (coli/gpu/mtp_graphs.py). The same
        layer and inputs as step(), not the same bits (the attention is split differently). Inside a captured
        round the tokens come from the step's device inputs (the verify rows' argmax), not from ids."""
        from coli.model.batch import attention_rows, position_rows, segment_angles
        m, c, b, w = self.model, self.model.config, self.model.backend, self.w
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        S = int(ids.shape[0])
        x, xn = self._combine(ids, h)                                              # [S, H] each
        segs = position_rows(cache, S)
        cache.reserve(S)
        cos, sin = segment_angles(c, segs)                                        # [S, dr/2], per row as alone
        lw = w.layer
        p = m._attention_inputs(0, lw.attn, xn, cos, sin)
        o = attention_rows(m, 0, lw.attn, p, segs, [None] * S)                    # [S, nh*dv]; cache layer 0
        cache.length = segs[-1].start + 1
        return self._finish(x, b.linear(o, lw.attn.o))

    def _combine(self, ids: np.ndarray, h: Array) -> tuple[Array, Array]:
        """x = eh_proj(concat[enorm(embed(ids)), hnorm(h)]) [S, H], as two half-width products, and the layer's
        input norm of it (one op with the products' add: add_rms_norm). -> (x, xn)."""
        m, c, b, w = self.model, self.model.config, self.model.backend, self.w
        e = b.rms_norm(b.embed(m.embed, ids), w.enorm, c.rms_norm_eps)            # [S, H]
        hh = b.rms_norm(h, w.hnorm, c.rms_norm_eps)                               # [S, H]
        return b.add_rms_norm(b.linear(e, w.eh_emb), b.linear(hh, w.eh_hid), w.layer.input_norm, c.rms_norm_eps)

    def _finish(self, x: Array, a: Array) -> tuple[Array, Array]:
        """The layer after its attention (x [S, H] its input, a [S, H] the attention's output): the residual add,
        MoE + shared expert, shared_head.norm, the lm_head. -> (g [S, H], logits [S, V])."""
        m, c, b, w = self.model, self.model.config, self.model.backend, self.w
        lw = w.layer
        x, x2 = b.add_rms_norm(x, a, lw.post_norm, c.rms_norm_eps)               # [S, H] each
        idx, wts = b.route(x2, lw.router, lw.router_bias, c.n_group, c.topk_group, c.num_experts_per_tok,
                           c.norm_topk_prob, c.routed_scaling_factor)              # [S, K], [S, K]
        if not isinstance(idx, np.ndarray):
            # a round being captured (coli/gpu/mtp_graphs.py): the choice stayed on the device, the round's slot
            # table of the MTP layer's resident experts serves it
            routed = b.moe_step(self.layer_index, x2, idx)
        else:
            wanted = sorted(set(idx.ravel().tolist()))
            routed = b.moe(x2, idx, wts, self.experts.stream(self.layer_index, wanted))
        shared = b.swiglu(x2, lw.shared_gate, lw.shared_up, lw.shared_down)
        _, g = b.add_rms_norm(x, routed, w.head_norm, c.rms_norm_eps, shared)     # x + (routed + shared), normed
        return g, b.linear(g, m.lm_head)                                          # [S, H], [S, V]


def load_mtp_head(model: GlmMoeDsaModel) -> MtpHead:
    """The model's MTP head on its backend, or MtpUnavailable naming why the model has none. On the GPU its experts
    live where the VRAM plan put them (coli.gpu.setup.plan_mtp, on the model's VramExperts as `mtp_mode`): resident
    (also with every main expert resident, and without a budget), or uploaded from the container when a draft reads
    them."""
    experts = None
    if model.backend.name == "cuda" and getattr(model.weights, "mtp_layer", None) is not None:
        from coli.gpu.cuda_weights import ResidentExperts, UploadedExperts
        mode = getattr(model.experts, "mtp_mode", "resident")
        if mode == "none":
            raise MtpUnavailable(f"--mtp: {getattr(model.experts, 'mtp_problem', None) or 'no VRAM for the MTP layer'}"
                                 f"; run with --mtp off")
        if mode == "upload":
            experts = UploadedExperts(model.backend.rt, model.weights)
        else:
            experts = ResidentExperts(model.backend.rt, model.weights, layers=[mtp_layer(model.config)])
    return MtpHead(model, model.weights, experts)


def row_round(head: MtpHead, last: int, d1: int, cache: KVCache, mtp_cache: KVCache) -> tuple[list[int], list[int]]:
    """A greedy round of one draft in a shape that does not depend on what is accepted, both caches at P positions:

        verify    [last, d1] at P, P+1 as two one-position rows (coli.model.batch.forward_rows)  -> argmax va [2]
        catch-up  the MTP layer over both verified rows (h_P, va[0]), (h_P+1, va[1]) at P, P+1   -> argmax ma [2]

    Row 1 of the catch-up is right only if d1 is accepted (va[0] == d1) -- then va[0] is d1 -- and is past the MTP
    cache's end otherwise, so the next draft is ma[a] either way (a = accepted drafts) and nothing waits: the
    caller cuts both caches to P + a + 1. -> (va, ma); both caches advanced by 2. This is the eager form (every
    kernel issued from here) of what coli/gpu/mtp_graphs.py replays as one CUDA graph."""
    from coli.model.batch import forward_rows
    b = head.model.backend
    hn, logits = forward_rows(head.model, cache, [last, d1])                     # [2, H], [2, V]
    va = [int(t) for t in b.argmax(logits)]
    _, ml = head.step_rows(va, hn, mtp_cache)                                   # [2, V]
    return va, [int(t) for t in b.argmax(ml)]


class EagerRowRounds:
    """row_round as a head's `rounds` (the graphs' interface) with every kernel issued eagerly: the reference the
    replayed rounds are checked against, and the way to run row rounds on the numpy backend (tests)."""

    last_reason = "eager row rounds"

    def __init__(self, head: MtpHead):
        self.head = head

    def round(self, last: int, d1: int, cache: KVCache, mtp_cache: KVCache) -> tuple[list[int], list[int]]:
        return row_round(self.head, last, d1, cache, mtp_cache)


# ---- acceptance ---------------------------------------------------------------------------------------------
def accept_greedy(drafts: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """drafts [k], target_argmax [k+1] (the main model's argmax after each verified position) -> the tokens this
    round emits: the longest matching prefix of the drafts, then the target's own next token."""
    out = []
    for j, d in enumerate(drafts):
        if int(target_argmax[j]) != int(d):
            break
        out.append(int(d))
    out.append(int(target_argmax[len(out)]))
    return out


def accept_sampled(drafts: Sequence[int], q: Sequence[np.ndarray], p: Sequence[np.ndarray],
                   rng: np.random.Generator) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). drafts [k] were drawn from q[j] [V]; p [k+1]
    are the target's distributions after each verified position. Draft j is kept with probability
    min(1, p_j(d)/q_j(d)); the first rejected one is replaced by a draw from norm(max(p_j - q_j, 0)) and ends the
    round; with every draft kept the last token is drawn from p[k]. Each emitted token is distributed as the
    target's, whatever q is."""
    out = []
    for j, d in enumerate(drafts):
        pj, qj = p[j], q[j]
        if rng.random() * qj[d] < pj[d]:           # u < p/q without dividing (q[d] > 0: d was drawn from q)
            out.append(int(d))
            continue
        resid = np.maximum(pj - qj, 0.0)
        total = resid.sum()
        # p == q up to rounding: the rejection had probability ~0, the residual is empty; p itself is then right
        dist = resid / total if total > 0 else pj
        out.append(int(rng.choice(dist.shape[0], p=dist)))
        return out
    k = len(drafts)
    out.append(int(rng.choice(p[k].shape[0], p=p[k])))
    return out


# ---- statistics ------------------------------------------------------------------------------------------------
@dataclass
class MtpStats:
    drafts: int                                        # k (the most drafted per round)
    rounds: int = 0                                    # verification steps (plain steps included, k = 0)
    tokens: int = 0                                    # tokens emitted by the rounds
    drafted: list[int] = field(default_factory=list)   # per draft position: rounds that drafted it
    accepted: list[int] = field(default_factory=list)  # per draft position: rounds that accepted it
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_rounds: int = 0                              # auto: rounds run without drafting

    def __post_init__(self):
        self.drafted = self.drafted or [0] * self.drafts
        self.accepted = self.accepted or [0] * self.drafts

    def record(self, k: int, n_accepted: int) -> None:
        self.rounds += 1
        self.tokens += n_accepted + 1
        if k == 0:
            self.plain_rounds += 1
        for j in range(k):
            self.drafted[j] += 1
            self.accepted[j] += j < n_accepted

    @property
    def acceptance(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.accepted, self.drafted)]

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "rounds": self.rounds, "plain_rounds": self.plain_rounds,
                "tokens": self.tokens, "tokens_per_step": round(self.tokens_per_step, 4),
                "acceptance_per_position": [None if a is None else round(a, 4) for a in self.acceptance],
                "drafted": list(self.drafted), "accepted": list(self.accepted),
                "draft_s": round(self.draft_s, 6), "verify_s": round(self.verify_s, 6)}


class AutoChoice:
    """`--mtp auto`: per round, draft (k = 1) or not (k = 0), whichever the measured figures say yields more tokens
    per second: a plain round emits 1 token in its measured time, a drafting round its measured tokens per round in
    its measured time (draft + verify). The other choice is re-measured after `explore` rounds, then after twice as
    many each time it still loses (up to `max_explore`), so a change (experts turning resident, acceptance falling)
    is seen and a settled choice costs little measuring."""

    DECAY = 0.75       # weight of a choice's earlier rounds each time it is measured again

    def __init__(self, explore: int = 8, max_explore: int = 128):
        self.explore, self.max_explore = explore, max_explore
        self.time = {0: [0.0, 0], 1: [0.0, 0]}       # k -> [seconds, rounds]
        self.tokens = {0: 0, 1: 0}
        self.n = 0
        # rounds between re-measurements: doubled (up to max_explore) each time the other choice still loses, so a
        # settled choice costs ever less measuring (a losing drafting round, or a catch-up after plain rounds);
        # back to `explore` when the choice flips
        self.interval = explore
        self.next_explore = explore
        self._settled: int | None = None

    def choose(self) -> int:
        self.n += 1
        for k in (0, 1):                               # measure both first
            if self.time[k][1] == 0:
                return k
        best = self.best()
        if best != self._settled:
            self._settled, self.interval = best, self.explore
            self.next_explore = self.n + self.interval
        if self.n >= self.next_explore:
            self.interval = min(2 * self.interval, self.max_explore)
            self.next_explore = self.n + self.interval
            return 1 - best
        return best

    def best(self) -> int:
        """The rule itself, without the re-measuring: 1 (draft) where the drafting rounds' measured tokens per
        second beat the plain rounds', else 0 (`coli bench stream --verify` applies it to a slice's step costs)."""
        rate = {k: self.tokens[k] / self.time[k][0] if self.time[k][0] > 0 else float("inf") for k in (0, 1)}
        return 1 if rate[1] > rate[0] else 0

    def record(self, k: int, seconds: float, tokens: int) -> None:
        # decayed sums: each choice's newest rounds weigh most, so a change shows at its next re-measurements
        # instead of being averaged away by hundreds of old rounds
        self.time[k][0] = self.time[k][0] * self.DECAY + seconds
        self.time[k][1] += 1
        self.tokens[k] = self.tokens[k] * self.DECAY + tokens


@dataclass
class MtpCarry:
    """What the MTP side keeps between the turns of one conversation (one main KV cache): its own cache of positions
    [0, mtp_cache.length) and the main model's hidden states of the positions after it up to the main cache's end
    [m, H], with the tokens one ahead of them but the last (that one opens the next turn's prompt)."""

    cache_ref: Any                # weakref.ref to the main KVCache it is in step with
    mtp_cache: KVCache
    hidden: np.ndarray            # [m, H] host float32
    ids: list[int]                # [m - 1] (empty when m = 0)


class SpeculativeDecoder:
    """The main model's cache plus the MTP head's, kept in step (see the module docstring for one round)."""

    def __init__(self, head: MtpHead, cache: KVCache, sampler: Sampler, drafts: int | str,
                 carry: MtpCarry | None = None):
        self.head, self.model, self.cache, self.sampler = head, head.model, cache, sampler
        self.auto = AutoChoice() if drafts == "auto" else None
        self.k = 1 if drafts == "auto" else int(drafts)
        if not 1 <= self.k <= MAX_DRAFTS:
            raise ColiError(f"MTP drafts must be 1..{MAX_DRAFTS} (got {drafts})")
        self.carry = carry if carry is not None and self.can_continue(cache, carry) else None
        self.mtp_cache = self.carry.mtp_cache if self.carry else head.new_cache(max(16, cache.capacity))
        # The MTP cache holds positions [0, mtp_cache.length); the pairs after it wait here: main hidden states of
        # positions mtp_cache.length .. P-1 [m, H] and the tokens one ahead of them (the last one is `last`).
        self.pending_h: Array | None = None
        self.pending_ids: list[int] = []
        self.last: int | None = None
        # after a row round (row_round): the next round's d_1, already drafted -- the MTP cache is then in step
        # with the main one and nothing waits (pending_h None)
        self.ready: int | None = None
        self._qbuf = self._qview = None      # the queue's device buffer and the view of it pending_h is (_queue)
        self.stats = MtpStats(self.k)

    @staticmethod
    def can_continue(cache: KVCache, carry: MtpCarry | None) -> bool:
        """Whether drafting can go on over this cache: it is new, or `carry` is in step with it."""
        # the cache may have been cut back since (a session's shorter common prefix), not grown without MTP
        return cache.length == 0 or (carry is not None and carry.cache_ref() is cache
                                     and cache.length <= carry.mtp_cache.length + carry.hidden.shape[0])

    def carry_out(self) -> MtpCarry:
        """The state to continue with after the main cache was cut back to the positions the turn's tokens cover
        (Generation does that when it stops): the queued hidden states and tokens are cut to match."""
        b, R = self.model.backend, self.cache.length
        M = min(self.mtp_cache.length, R)
        self.mtp_cache.truncate(M)
        h = np.zeros((0, self.model.config.hidden_size), np.float32)
        ids: list[int] = []
        if R > M and self.pending_h is not None:
            h = np.array(b.to_host(self.pending_h))[:R - M]
            ids = self.pending_ids[:R - M - 1]
        return MtpCarry(weakref.ref(self.cache), self.mtp_cache, h, ids)

    @property
    def greedy(self) -> bool:
        return self.sampler.params.greedy

    def _pick(self, logits_host: np.ndarray) -> tuple[int, np.ndarray | None]:
        if self.greedy:
            return int(np.argmax(logits_host)), None
        q = self.sampler.distribution(logits_host)
        return self.sampler.draw(q), q

    def prefill(self, ids: Sequence[int]) -> int:
        """Run the prompt (after whatever the caches hold) and return the first new token."""
        b = self.model.backend
        R = self.cache.length
        if not self.can_continue(self.cache, self.carry):
            raise ColiError("the MTP cache is out of step with the model's cache (a session continued without MTP)")
        hn, logits = self.model.forward_hidden(ids, self.cache)                  # [S, H], [S, V]
        tok, _ = self._pick(b.to_host(b.last_row(logits))[0])
        self.ready = None
        M = min(self.mtp_cache.length, R)
        self.mtp_cache.truncate(M)              # (the conversation may have been cut back below it)
        if R > M:   # an earlier turn's queued pairs: hidden states of M..R-1, tokens M+1..R-1, then this prompt's
            c = self.carry
            self.pending_h = b.upload(np.concatenate([c.hidden[:R - M], b.to_host(hn)]))
            self.pending_ids = c.ids[:R - M - 1] + list(ids) + [tok]
        else:
            self.pending_h, self.pending_ids = hn, list(ids[1:]) + [tok]
        self.last = tok
        return tok

    def step(self, room: int) -> list[int]:
        """One round: at least 1 and at most min(k + 1, room) new tokens (room >= 1: what max_tokens leaves)."""
        k = self._choose(room)
        if self.greedy and k == 0:
            return self._plain_round()
        if self.greedy and k == 1 and self.head.rounds is not None:
            return self._row_round()
        ids = self.begin_round(room, k)
        if self.greedy and self.head.verify is not None:
            got = self.head.verify.greedy(self.cache, ids)                        # replayed: rows' argmax, hn
            if got is not None:
                return self.end_round(got[1], None, argmax=got[0])
        hn, logits = self.model.forward_hidden(ids, self.cache)                   # [k+1, H], [k+1, V]
        return self.end_round(hn, logits)

    def _choose(self, room: int) -> int:
        """This round's draft count: the fixed k or auto's choice, at most what room leaves."""
        k = self.auto.choose() if self.auto is not None else self.k
        return max(0, min(k, room - 1))

    def begin_round(self, room: int, k: int | None = None) -> list[int]:
        """A round's first half: draft, and -> the verify row's ids [last, d_1..d_k] (k <= room - 1; None: chosen
        here). The caller runs them after the main cache's positions, all logits (alone: forward_hidden; in a batch:
        one all_logits row of coli.model.batch.forward_batch_hidden), then hands the row's hidden states and logits
        to `end_round`."""
        k = self._choose(room) if k is None else k
        if self.ready is not None:      # after a row round d_1 is drafted and nothing waits to chain from: one draft
            k = min(k, 1)
            if k == 0:                  # a plain step: d_1 guessed the token it now computes
                self.ready = None
        self._t0 = time.perf_counter()
        self._drafts, self._q = self._draft(k)
        self._t1 = time.perf_counter()
        self._P = self.cache.length
        return [self.last] + self._drafts

    def _row_round(self) -> list[int]:
        """A greedy round of one draft through the head's `rounds` (row_round, replayed from a CUDA graph on the
        GPU): the same tokens as begin_round/end_round, and the next d_1 comes with them."""
        b = self.model.backend
        t0 = time.perf_counter()
        if self.ready is None:          # catch the MTP cache up on the waiting pairs: it drafts d_1
            _, logits = self.head.step(self.pending_ids, self.pending_h, self.mtp_cache)
            self.ready = int(b.argmax(b.last_row(logits))[0])
            self.pending_h, self.pending_ids = None, []
        t1 = time.perf_counter()
        P, d1 = self.cache.length, self.ready
        if self.mtp_cache.length != P:
            raise ColiError(f"MTP round: the MTP cache holds {self.mtp_cache.length} positions, the model's {P}")
        va, ma = self.head.rounds.round(self.last, d1, self.cache, self.mtp_cache)
        out = [d1, va[1]] if va[0] == d1 else [va[0]]
        a = len(out) - 1
        self.cache.truncate(P + a + 1)
        self.mtp_cache.truncate(P + a + 1)
        self.ready, self.last = ma[a], out[-1]
        t2 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self.stats.record(1, a)
        if self.auto is not None:
            self.auto.record(1, t2 - t0, len(out))
        return out

    def _plain_round(self) -> list[int]:
        """A greedy round without drafts (auto's k = 0, the last token max_tokens leaves): the model's own step --
        a replayed CUDA graph on the GPU, the same one decoding without MTP runs -- which also gives its hidden
        state; it waits in the queue for the MTP layer's next catch-up."""
        t0 = time.perf_counter()
        tok, h = self.model.greedy_hidden([self.last], self.cache)                # h [1, H]
        self.ready = None               # a drafted d_1 guessed the token just computed
        self._queue(h, [tok])
        self.last = tok
        t1 = time.perf_counter()
        self.stats.verify_s += t1 - t0
        self.stats.record(0, 0)
        if self.auto is not None:
            self.auto.record(0, t1 - t0, 1)
        return [tok]

    def _queue(self, h: Array, ids: list[int]) -> None:
        """Append hidden states h [n, H] (on the backend) and the tokens one ahead of them to the MTP side's queue.
        The queue lives on the device in a buffer of doubling capacity (_qbuf; pending_h a view of its first rows), so
        a run of plain rounds appends one row each instead of copying the whole queue each time, and never goes
        through the host."""
        b = self.model.backend
        if self.pending_h is None or self.pending_h.shape[0] == 0:
            self.pending_h, self.pending_ids = h, list(ids)
            return
        m, n = self.pending_h.shape[0], h.shape[0]
        if self.pending_h is not self._qview or self._qbuf.shape[0] < m + n:
            buf = b.empty((max(16, 2 * (m + n)), self.model.config.hidden_size))    # [capacity, H]
            b.place_rows(buf, 0, self.pending_h)
            self._qbuf = buf
        b.place_rows(self._qbuf, m, h)
        self._qview = b.row_range(self._qbuf, 0, m + n)                          # [m + n, H]
        self.pending_h, self.pending_ids = self._qview, self.pending_ids + list(ids)

    def end_round(self, hn: Array, logits: Array | None, argmax: list[int] | None = None) -> list[int]:
        """The verified row's final-normed hidden states [k+1, H] and logits [k+1, V] (on the backend; the main cache
        already advanced by the k+1 positions) -> the round's tokens; both caches rolled back to match. A greedy
        round may give its rows' argmax [k+1] instead of the logits (a replayed verify step's)."""
        if argmax is not None and not self.greedy:
            raise ValueError("end_round: a sampled round needs the logits, not the argmax")
        k = len(self._drafts)
        out = self._verify(self._drafts, self._q, self._P, hn, logits, argmax)
        t2 = time.perf_counter()
        self.stats.draft_s += self._t1 - self._t0
        self.stats.verify_s += t2 - self._t1
        self.stats.record(k, len(out) - 1)
        if self.auto is not None:
            self.auto.record(min(k, 1), t2 - self._t0, len(out))
        return out

    def _draft(self, k: int) -> tuple[list[int], list[np.ndarray]]:
        b, head = self.model.backend, self.head
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        if k == 0:
            return drafts, qs
        if self.ready is not None:      # drafted by the row round before (greedy, one draft: begin_round saw to it)
            d, self.ready = self.ready, None
            return [d], qs
        g, logits = head.step(self.pending_ids, self.pending_h, self.mtp_cache)    # catch up, then draft 1
        for j in range(k):
            if j:
                g, logits = head.step([drafts[-1]], g, self.mtp_cache)             # chained on its own output
            d, q = self._pick(b.to_host(b.last_row(logits))[0])
            drafts.append(d)
            if q is not None:
                qs.append(q)
            g = b.last_row(g)
        return drafts, qs

    def _verify(self, drafts: list[int], qs: list[np.ndarray], P: int, hn: Array, logits: Array | None,
                argmax: list[int] | None = None) -> list[int]:
        b = self.model.backend
        if self.greedy:
            out = accept_greedy(drafts, b.argmax(logits) if argmax is None else argmax)
        else:
            host = b.to_host(logits)
            ps = [self.sampler.distribution(host[j]) for j in range(len(drafts) + 1)]
            out = accept_sampled(drafts, qs, ps, self.sampler.rng)
        a = len(out) - 1
        self.cache.truncate(P + a + 1)                  # keep `last` and the accepted drafts
        if drafts:
            # the MTP cache ran to P + k - 1; positions from P on were built on draft hiddens: drop them, and
            # queue the verified hidden states of P..P+a with the tokens one ahead of them
            self.mtp_cache.truncate(P)
            self.pending_h, self.pending_ids = b.rows(hn, a + 1), out
        else:
            # a plain step: the MTP cache did not move; its queue grows by this position
            self._queue(hn, out)
        self.last = out[-1]
        return out
