"""One model step over a batch of sequences' rows (stages/executor/scheduler.py Row): the tokens each row
samples. Rows go through coli.model.batch in one call (each row gets exactly what it gets alone); when every
sampling row is greedy the argmax is taken on the backend (greedy_batch: logits stay on the GPU), otherwise the
logits come back and each sequence's own Sampler picks (np.argmax for its greedy rows: the same first maximum).
A drafting sequence's row is its MTP verify row [last, d1..dk] (all logits): its SpeculativeDecoder takes the row's
hidden states and logits and gives the round's tokens (choose_with_rounds)."""

from __future__ import annotations

import numpy as np

from coli.model.batch import BatchRow, forward_batch, forward_batch_hidden, greedy_batch
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


def choose_with_rounds(model, rows: list[Row], rounds: list) -> list:
    """rows with rounds[i] the SpeculativeDecoder of row i's drafting sequence (its row is the verify row of a round
    it began), or None -> per row: the round's tokens (a list), the token a plain row chose, or None."""
    if not any(r is not None for r in rounds):
        return choose_tokens(model, rows)
    b, V = model.backend, model.config.vocab_size
    batch = [BatchRow(r.seq.cache, r.ids, all_logits=spec is not None) for r, spec in zip(rows, rounds)]
    out: list = []
    for r, spec, (hn, logits) in zip(rows, rounds, forward_batch_hidden(model, batch)):
        if spec is not None:
            out.append(spec.end_round(hn, logits))             # hn [k+1, H], logits [k+1, V]
        elif not r.samples:
            out.append(None)
        else:
            last = np.asarray(b.to_host(logits), dtype=np.float32).reshape(-1, V)[-1]   # [V]
            out.append(int(np.argmax(last)) if r.seq.sampling.greedy else r.seq.sampler(last))
    return out


def round_alone(model, r: Row, spec) -> list[int]:
    """A verify row by itself (a failed batch is retried row by row)."""
    hn, logits = model.forward_hidden(r.ids, r.seq.cache)       # [k+1, H], [k+1, V]
    return spec.end_round(hn, logits)
