"""One forward step over several sequences at once (continuous batching), each exactly as it runs alone.

    rows = [BatchRow(cache_a, [tok_a]), BatchRow(cache_b, prompt_chunk_b)]
    logits = forward_batch(model, rows)        # [1, V] per row (all_logits: [len(ids), V])

Each row is one sequence's share of the step: its own KV cache (advanced by the step, as forward() does) and
its new tokens (one for a decode step, a chunk of its prompt for prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coli.model.forward import GlmMoeDsaModel
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
    return [model.forward(r.ids, r.cache, r.all_logits) for r in rows]


def greedy_batch(model: GlmMoeDsaModel, rows: list[BatchRow]) -> list[int]:
    """forward_batch's greedy next token per row (first maximum of its last position's logits), taken on the
    backend as model.greedy does."""
    return [model.greedy_eager(r.ids, r.cache) for r in rows]
