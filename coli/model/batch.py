"""One forward step over several sequences at once (continuous batching), each exactly as it runs alone.

    rows = [BatchRow(cache_a, [tok_a]), BatchRow(cache_b, prompt_chunk_b)]
    logits = forward_batch(model, rows)        # [1, V] per row (all_logits: [len(ids), V])

Each row is one sequence's share of the step: its own KV cache (advanced by the step, as forward() does) and
its new tokens (one for a decode step, a chunk of its prompt for prefill).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coli.model.backend import cos_sin_table
from coli.model.forward import GlmMoeDsaModel, begin_step, checked_ids
from coli.model.kv_cache import KVCache


@dataclass
class BatchRow:
    """One sequence's share of a step."""

    cache: KVCache          # that sequence's own cache (advanced by the step, as forward() does)
    ids: Sequence[int]      # its new tokens: 1 for a decode step, a chunk of its prompt for prefill
    all_logits: bool = False  # logits for every new position (verification steps) or only the last


def forward_batch(model: GlmMoeDsaModel, rows: list[BatchRow]) -> list[np.ndarray]:
    """Run every row's new positions in one step. -> host float32 logits per row: [len(ids), V] if all_logits
    else [1, V]."""
    logits, wanted = step_logits(model, rows, all_positions=True)
    host = model.backend.to_host(logits)                                # [sum of wanted rows, V]
    out, at = [], 0
    for n in wanted:
        out.append(np.array(host[at:at + n]))
        at += n
    return out


def forward_batch_hidden(model: GlmMoeDsaModel, rows: list[BatchRow]) -> list[tuple]:
    """forward_batch with each row's final-normed hidden states too, both left on the backend: per row
    (hidden [n, H], logits [n, V]), n = len(ids) if all_logits else 1. An MTP verify row (coli.model.mtp
    SpeculativeDecoder.end_round) reads all its logits and drafts its next round from the hidden states."""
    b = model.backend
    logits, wanted, hn = _step(model, rows, all_positions=True)
    out, at = [], 0
    for n in wanted:
        out.append((b.row_range(hn, at, n), b.row_range(logits, at, n)))
        at += n
    return out


def greedy_batch(model: GlmMoeDsaModel, rows: list[BatchRow]) -> list[int]:
    """forward_batch's greedy next token per row (first maximum of its last position's logits, whatever its
    all_logits), taken on the backend as model.greedy does: only the R tokens come back to the host."""
    if len(rows) == 1:          # one sequence: model.greedy, whose decode step may be a replayed CUDA graph
        ids = _check(model, rows)[0]
        return [model.greedy(ids, rows[0].cache)]
    graphs = batch_graphs(model)
    if graphs is not None:      # a pure decode step replayed from a CUDA graph of this batch (None: run it eagerly)
        toks = graphs.greedy(rows, _check(model, rows))
        if toks is not None:
            return toks
    logits, _ = step_logits(model, rows, all_positions=False)           # [R, V]
    return [int(t) for t in model.backend.argmax(logits)]


_graph_decoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def batch_graphs(model: GlmMoeDsaModel):
    """The model's replayed batched decode steps (coli.gpu.batch_graphs.BatchGraphDecoder, from its backend's
    batch_graph_decoder), or None: the backend has none, or they are off (COLI_BATCH_GRAPHS, COLI_GRAPHS)."""
    if model not in _graph_decoders:
        make = getattr(model.backend, "batch_graph_decoder", None)
        _graph_decoders[model] = make(model) if make is not None else None
    return _graph_decoders[model]


@dataclass
class _Segment:
    """Where one row's positions sit in the step's concatenated activations."""

    row: BatchRow
    offset: int              # its first row in [S_total, ...]
    n: int                   # its new positions
    start: int               # its cache length before the step (its first position)

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.n)               # [n]


def _select_row(b, r: int | None) -> None:
    """Inside a captured batched decode step (coli/gpu/batch_graphs.py) the backend's step reads row r's position,
    cache length and attention span while row r's attention runs (None: the step's batch-wide inputs again)."""
    st = getattr(b, "step", None)
    if st is not None and hasattr(st, "select"):
        st.select(r)


def _check(model: GlmMoeDsaModel, rows: list[BatchRow]) -> list[np.ndarray]:
    """Each row's ids as int64, or a ValueError naming the first bad row before anything is computed (a bad row
    must not leave another row's cache half advanced)."""
    if not rows:
        raise ValueError("forward_batch() needs at least one row")
    V = model.config.vocab_size
    seen: dict[int, int] = {}
    out = []
    for r, row in enumerate(rows):
        ids = np.asarray(row.ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError(f"batch row {r} has no new tokens: give each row at least one")
        if ids.min() < 0 or ids.max() >= V:
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise ValueError(f"batch row {r}: token id {bad} is outside the vocabulary (0..{V - 1})")
        if id(row.cache) in seen:
            raise ValueError(f"batch rows {seen[id(row.cache)]} and {r} share one KV cache: each sequence "
                             f"needs its own (model.new_cache())")
        seen[id(row.cache)] = r
        out.append(ids)
    return out


def step_logits(model: GlmMoeDsaModel, rows: list[BatchRow], all_positions: bool):
    """The batched step, its logits left on the backend. -> (logits [R, V], how many of its rows each batch row
    has). With all_positions a row with all_logits gets all its positions, the others their last; without, every
    row its last (greedy_batch; what a captured batched decode step computes, coli/gpu/batch_graphs.py)."""
    logits, wanted, _ = _step(model, rows, all_positions)
    return logits, wanted


def _step(model: GlmMoeDsaModel, rows: list[BatchRow], all_positions: bool):
    """step_logits, and the wanted rows' final-normed hidden states [R, H] the logits came from."""
    c, b = model.config, model.backend
    ids = _check(model, rows)
    segs, at = [], 0
    for row, r_ids in zip(rows, ids):
        segs.append(_Segment(row, at, int(r_ids.size), row.cache.length))
        at += int(r_ids.size)
    S = at
    for s in segs:
        s.row.cache.reserve(s.n)
    h = _layers(model, segs, np.concatenate(ids))                      # [S, H]
    for s in segs:
        s.row.cache.length = s.start + s.n

    # the rows whose logits are wanted, gathered so the final norm and lm_head run once
    wanted = [s.n if (all_positions and s.row.all_logits) else 1 for s in segs]
    R = sum(wanted)
    if R == S:
        hw = h
    else:
        hw = b.empty((R, c.hidden_size))                                # [R, H]
        at = 0
        for s, n in zip(segs, wanted):
            b.place_rows(hw, at, b.row_range(h, s.offset + s.n - n, n))
            at += n
    hn = b.rms_norm(hw, model.final_norm, c.rms_norm_eps)
    return b.linear(hn, model.lm_head), wanted, hn                      # [R, V], [R, H]


def _layers(model: GlmMoeDsaModel, segs: list[_Segment], ids: np.ndarray):
    """Every decoder layer over the step's rows ids [S] (segments laid end to end): the row-wise work once over all S
    rows, attention per segment over its own cache rows. -> h [S, H] before the final norm. The caches' lengths are
    the caller's to advance (segments of one cache at consecutive positions share it: forward_rows)."""
    c, b = model.config, model.backend
    cos, sin = segment_angles(c, segs)                                  # [S, dr/2] each

    eps, layers = c.rms_norm_eps, model.layers
    begin_step(model.experts, int(ids.shape[0]))                        # the union of every row's experts
    h = b.embed(model.embed, ids)                                       # [S, H]
    allowed: list = [None] * len(segs)                                  # per row: its last full indexer's mask
    # each residual add with the RMSNorm that reads its sum as one op (add_rms_norm), as in GlmMoeDsaModel.forward
    x = b.rms_norm(h, layers[0].input_norm, eps)                        # [S, H]
    for i, lw in enumerate(layers):
        p = model._attention_inputs(i, lw.attn, x, cos, sin)            # every projection once over all rows
        o = attention_rows(model, i, lw.attn, p, segs, allowed)         # [S, nh*dv]
        h, x2 = b.add_rms_norm(h, b.linear(o, lw.attn.o), lw.post_norm, eps)   # [S, H] each
        nxt = layers[i + 1].input_norm if i + 1 < len(layers) else None
        h, x = model._add_mlp(h, *model._mlp(i, lw, x2, h), nxt)         # one router, one stream() of the union
    return h


def segment_angles(c, segs: list[_Segment]) -> tuple[np.ndarray, np.ndarray]:
    """RoPE angles cos, sin [S, dr/2] of the segments' positions end to end, each segment's as it alone computes them
    (the same call, so the same values bit for bit)."""
    tables = [cos_sin_table(s.positions, c.qk_rope_head_dim, c.rope_theta) for s in segs]
    return np.concatenate([t[0] for t in tables]), np.concatenate([t[1] for t in tables])


def attention_rows(model: GlmMoeDsaModel, i: int, w, p, segs: list[_Segment], allowed: list):
    """Layer i's attention of each segment over its own cache (cache layer i), its output rows placed where the
    segment's rows are: -> o [S, nh*dv] before o_proj. allowed[r] (segment r's last full indexer's mask) is updated
    in place."""
    c, b = model.config, model.backend
    S = sum(s.n for s in segs)
    o = b.empty((S, c.num_attention_heads * c.v_head_dim)) if len(segs) > 1 else None   # [S, nh*dv]
    for r, s in enumerate(segs):                                        # attention per sequence, its own cache
        _select_row(b, r)
        o_r, allowed[r] = model._attention_segment(i, w, p.rows(b, s.offset, s.n), s.positions, s.row.cache,
                                                   s.start, allowed[r])
        if o is None:
            o = o_r
        else:
            b.place_rows(o, s.offset, o_r)
    _select_row(b, None)
    return o


def position_rows(cache: KVCache, n: int) -> list[_Segment]:
    """n consecutive positions of ONE sequence after its cache, as n one-position segments of that cache: each
    position's attention runs as its own decode step would (row j sees positions 0..start+j: its own key is
    written before it attends, the later ones after)."""
    start = cache.length
    return [_Segment(BatchRow(cache, [0]), j, 1, start + j) for j in range(n)]


def forward_rows(model: GlmMoeDsaModel, cache: KVCache, ids: Sequence[int]):
    """forward_hidden(ids, cache) with the S positions run as S one-position rows of one batched step (each
    position's attention its own decode step's, the linears once over the S rows): an MTP verify step in a fixed
    shape that a CUDA graph replays (coli/gpu/mtp_graphs.py). -> (hidden [S, H] final-normed, logits [S, V]), on
    the backend; the cache advanced by S. The same tokens as forward_hidden (not the same bits: the attention is
    split differently)."""
    c, b = model.config, model.backend
    ids = checked_ids(ids, c.vocab_size, "forward_rows()")
    segs = position_rows(cache, int(ids.size))
    cache.reserve(len(segs))
    h = _layers(model, segs, ids)                                       # [S, H]
    cache.length = segs[-1].start + 1
    hn = b.rms_norm(h, model.final_norm, c.rms_norm_eps)               # [S, H]
    return hn, b.linear(hn, model.lm_head)                              # [S, H], [S, V]
