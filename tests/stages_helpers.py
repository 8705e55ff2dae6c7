"""Helpers for stage-core tests."""

from coli.stages.ramtier.core import RamTierCore, ResidencyTable


def make_core(n_slots, n_keys, pinned=(), max_inflight_reads=8):
    buf = bytearray(ResidencyTable.nbytes(n_keys, max(n_slots, 0)))
    table = ResidencyTable(buf, n_keys, max(n_slots, 0))
    return RamTierCore(n_slots, n_keys, table, pinned=pinned, max_inflight_reads=max_inflight_reads), table


def verify_row_beside_plain_rows(model, prompt: list[int], drafts: int, n: int = 30) -> dict:
    """The batching core (stages/executor/scheduler.py) driving MODEL (numpy or CUDA backend, an MTP layer loaded)
    one batched step per boundary as the executor does: a drafting sequence (PROMPT, N tokens, DRAFTS per round)
    whose verify row [last, d1..dk] (all logits, coli.model.batch.forward_batch_hidden) shares steps with a greedy
    plain row (prompt[3:15], 20 tokens) and a sampled one (prompt[1:9], 18 tokens, seed 99).
    -> {"mtp", "plain", "sampled": tokens, "shared": steps the verify row shared, "stats": the decoder's MtpStats}."""
    from coli.model.mtp import SpeculativeDecoder, load_mtp_head
    from coli.model.sampling import SamplingParams
    from coli.stages.executor.batch_step import choose_with_rounds
    from coli.stages.executor.scheduler import Row, Scheduler, Sequence

    head = load_mtp_head(model)
    sched = Scheduler(max_batch=3, step_tokens=8)
    drafting = Sequence("mtp", list(prompt), n, external=True)
    plain = Sequence("plain", prompt[3:15], 20)
    sampled = Sequence("sampled", prompt[1:9], 18, SamplingParams(False, 0.8, 0.9, 20, 99))
    for q in (drafting, plain, sampled):
        sched.submit(q)
    for q in sched.admit():
        sched.begin(q, model.new_cache(64), q.prompt, 0.0)
    spec = SpeculativeDecoder(head, drafting.cache, drafting.sampler, drafts)
    sched.commit_tokens(drafting, [spec.prefill(drafting.prompt)], 0.0)
    shared = 0
    for step in range(200):
        rows = sched.plan()
        rounds = [None] * len(rows)
        if drafting.finish is None:
            rows.append(Row(drafting, spec.begin_round(drafting.max_tokens - len(drafting.out)), True))
            rounds.append(spec)
        if not rows:
            break
        shared += len(rows) > 1 and rounds[-1] is not None
        chosen = choose_with_rounds(model, rows, rounds)
        plain_rows = [(r, c) for r, c, s in zip(rows, chosen, rounds) if s is None]
        sched.commit([r for r, _ in plain_rows], [c for _, c in plain_rows], float(step))
        if rounds[-1] is not None:
            sched.commit_tokens(drafting, chosen[-1], float(step))
    return {"mtp": drafting.out, "plain": plain.out, "sampled": sampled.out, "shared": shared, "stats": spec.stats}
