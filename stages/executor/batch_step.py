"""One model step over a batch of sequences' rows (stages/executor/scheduler.py Row): the tokens each row
samples. Rows go through coli.model.batch in one call (each row gets exactly what it gets alone); when every
sampling row is greedy the argmax is taken on the backend (greedy_batch: logits stay on the GPU), otherwise the
logits come back and each sequence's own Sampler picks (np.argmax for its greedy rows: the same first maximum)."""

from __future__ import annotations

import numpy as np

from coli.model.batch import BatchRow, forward_batch, greedy_batch
from coli.stages.executor.scheduler import Row


def choose_tokens(model, rows: list[Row]) -> list[int | None]:
    """rows -> the token each sampling row chose (None for a prefill chunk short of its prompt's end)."""
    if not rows:
        return []
    greedy = all(r.seq.sampling.greedy for r in rows if r.samples)
    batch = [BatchRow(r.seq.cache, r.ids) for r in rows]
    if greedy:
        return [int(t) if r.samples else None for r, t in zip(rows, greedy_batch(model, batch))]
    V = model.config.vocab_size
    return [r.seq.sampler(np.asarray(lg, dtype=np.float32).reshape(-1, V)[-1]) if r.samples else None
            for r, lg in zip(rows, forward_batch(model, batch))]


def choose_alone(model, r: Row) -> int | None:
    """One row by itself (a failed batch is retried row by row, so that only the failing request fails)."""
    if r.seq.sampling.greedy:
        tok = model.greedy(r.ids, r.seq.cache)
        return int(tok) if r.samples else None
    logits = model.forward(r.ids, r.seq.cache)           # [1, V]
    return r.seq.sampler(logits[-1]) if r.samples else None
