"""In a batch each sequence gets exactly the tokens it gets alone: the batching core (stages/executor/scheduler.py)
driving the real model (f32 oracle container, numpy backend) through one batched step per boundary
(stages/executor/batch_step.py), with prompts of different lengths joining and leaving mid-run, prefill chunked
small, one sequence cancelled and one sampled with its own seed. The oracle prompt's tokens are transformers'."""

import pytest

from coli.generate import Generation
from coli.loader import load_model
from coli.model.sampling import SamplingParams
from coli.stages.executor.batch_step import choose_tokens
from coli.stages.executor.scheduler import Row, Scheduler, Sequence
from oracles import load_oracle, oracle_dir
from stages_helpers import verify_row_beside_plain_rows


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """The default oracle with a random MTP layer added (numpy backend) and the oracle's prompt."""
    from checkpoints import with_mtp_layer

    src = oracle_dir(tmp_path_factory.mktemp("batch-mtp-oracles"), "default")
    model, _ = load_model(with_mtp_layer(src, tmp_path_factory.mktemp("batch-mtp") / "default-mtp", seed=11))
    return model, load_oracle(src)["prompt_ids"]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    d = oracle_dir(tmp_path_factory.mktemp("batch-oracles"), "default")
    model, _ = load_model(d)
    return model, load_oracle(d)


def alone(model, prompt, n, params=None):
    return list(Generation(model, prompt, n, params or SamplingParams(), ignore_eos=True))


def drive(model, sched: Scheduler, arrivals: dict[int, list[Sequence]], cancel_after: dict[str, int], steps=300):
    """Run steps; sequences arrive at given step numbers; a sequence of `cancel_after` is cancelled once it has
    that many tokens, while the next step is in flight. -> {request id: tokens}."""
    got: dict[str, list[int]] = {}
    for n in range(steps):
        for q in arrivals.get(n, []):
            sched.submit(q)
        for q in sched.reap():
            got[q.request_id] = q.out
        for q in sched.admit():
            sched.begin(q, model.new_cache(16), q.prompt, float(n))
        rows = sched.plan()
        if not rows and not sched.waiting and n > max(arrivals):
            break
        chosen = choose_tokens(model, rows)
        for q in sched.running:
            if len(q.out) == cancel_after.get(q.request_id, -1):
                assert sched.cancel(q.request_id)
        out = sched.commit(rows, chosen, float(n))
        for q in out.finished:
            got[q.request_id] = q.out
    return got


def test_sequences_joining_and_leaving_a_batch_get_their_solo_tokens(oracle):
    model, o = oracle
    p = o["prompt_ids"]                                      # 20 tokens
    prompts = {"full": p, "short": p[:3], "mid": p[5:16], "one": p[7:8], "cut": p[2:19]}
    lengths = {"full": 32, "short": 12, "mid": 20, "one": 6, "cut": 40}
    seqs = {k: Sequence(k, list(v), lengths[k]) for k, v in prompts.items()}
    sampled = Sequence("sampled", p[4:14], 16, SamplingParams(greedy=False, temperature=0.8, top_k=20, top_p=0.9,
                                                               seed=1234))
    # max_batch 3 and a 6-token budget: a queue forms, prompts are cut into chunks, decode rows ride along
    sched = Scheduler(max_batch=3, step_tokens=6)
    got = drive(model, sched, {0: [seqs["full"], seqs["short"]], 2: [seqs["mid"], sampled], 5: [seqs["one"]],
                               9: [seqs["cut"]]}, cancel_after={"cut": 5})
    assert got["full"] == o["greedy_tokens"]                 # transformers' greedy tokens, in a batch
    for k in ("short", "mid", "one"):
        assert got[k] == alone(model, prompts[k], lengths[k]), k
    assert got["sampled"] == alone(model, sampled.prompt, 16, SamplingParams(False, 0.8, 0.9, 20, 1234))
    cut = got["cut"]
    assert len(cut) == 5 and seqs["cut"].finish == "cancelled"     # the in-flight step's token was dropped
    assert cut == alone(model, prompts["cut"], 40)[:len(cut)]
    assert sched.counters["steps"] > 0 and not sched.running and not sched.waiting


@pytest.mark.parametrize("drafts", [1, 3])
def test_mtp_verify_rows_share_a_batched_step_and_every_sequence_gets_its_solo_tokens(mtp_model, drafts):
    """A drafting sequence's verify row [last, d1..dk] (all logits) in the same batched step as plain rows (one of
    them sampled): the drafting one's greedy tokens are its tokens without MTP, the others' their solo tokens."""
    model, p = mtp_model
    got = verify_row_beside_plain_rows(model, p, drafts)
    assert got["shared"] > 3                                  # the verify row did share steps with the others
    assert got["mtp"] == alone(model, p, 30)                  # no MTP, alone
    assert got["plain"] == alone(model, p[3:15], 20)
    assert got["sampled"] == alone(model, p[1:9], 18, SamplingParams(False, 0.8, 0.9, 20, 99))
    s = got["stats"]
    assert s.drafted[0] >= s.rounds - 1 and s.drafted[drafts - 1] > 0 and s.tokens == 29   # it drafted, every round
