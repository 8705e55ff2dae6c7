"""One forward step over several sequences (coli.model.batch) on the numpy engine: every sequence gets exactly
the tokens it gets alone and that transformers gives (f32 oracles built in this run), whatever joins, leaves,
is cancelled or has its prompt chunked beside it; the MoE asks for the union of the step's experts once per
layer."""

from __future__ import annotations

import numpy as np
import pytest

from coli.generate import Generation
from coli.loader import load_model
from coli.model.batch import BatchRow, forward_batch, greedy_batch
from oracles import assert_logits_close, load_oracle, oracle_dir


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory):
    return tmp_path_factory.mktemp("oracles")


def _oracle(root, name):
    d = oracle_dir(root, name)
    o = load_oracle(d)
    model, _ = load_model(d)
    return model, o


def _continuation_prompt(o) -> list[int]:
    """The oracle's second prompt: its first prompt, the greedy tokens and the extra ids (72+ tokens)."""
    return o["prompt_ids"] + o["greedy_tokens"] + o["continuation"]["extra_ids"]


class Seq:
    """One sequence as a scheduler would drive it: its prompt fed in chunks of `chunk` tokens (None: at once),
    then one token per step until it has `n_new` (the last one is not fed, as in Generation)."""

    def __init__(self, model, prompt, n_new: int, chunk: int | None = None):
        self.cache = model.new_cache(8)       # small: caches grow while batched
        self.pending = list(prompt)
        self.n_new, self.chunk = n_new, chunk
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []    # the last position's logits of each token produced

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.n_new

    def row(self) -> BatchRow:
        if self.pending:
            n = len(self.pending) if self.chunk is None else self.chunk
            ids, self.pending = self.pending[:n], self.pending[n:]
        else:
            ids = [self.tokens[-1]]
        self._prefill_left = bool(self.pending)
        return BatchRow(self.cache, ids)

    def took(self, token: int, logits: np.ndarray | None = None) -> None:
        if self._prefill_left:                # a prompt chunk that is not the last: its next token is unused
            return
        self.tokens.append(token)
        if logits is not None:
            self.logits.append(logits[-1])


def drive(model, seqs, joins=None, cancel_at=None, logits=False) -> int:
    """Step every running sequence in one batch until all are done. joins: {seq index: step it joins at};
    cancel_at: {seq index: step after which it is dropped, its cache discarded}. -> steps taken."""
    joins = joins or {}
    cancel_at = cancel_at or {}
    running: list[int] = []
    step = 0
    while True:
        running += [k for k in range(len(seqs)) if joins.get(k, 0) == step]
        running = [k for k in running if not seqs[k].done]
        if not running and all(joins.get(k, 0) <= step for k in range(len(seqs))):
            return step
        if running:
            rows = [seqs[k].row() for k in running]
            if logits:
                out = forward_batch(model, rows)
                for k, lg in zip(running, out):
                    seqs[k].took(int(np.argmax(lg[-1])), lg)
            else:
                for k, t in zip(running, greedy_batch(model, rows)):
                    seqs[k].took(t)
        for k, at in cancel_at.items():
            if at == step and k in running:
                running.remove(k)
                seqs[k].cache = None          # discarded: nothing of it may be needed by the others
        step += 1


def alone(model, prompt, n) -> list[int]:
    return list(Generation(model, prompt, n, ignore_eos=True))


@pytest.mark.parametrize("name", ["long-prompt", "shared-indexer"])
def test_prompts_of_different_lengths_in_one_batch_get_their_tokens_alone_and_transformers(oracle_root, name):
    model, o = _oracle(oracle_root, name)
    short = o["prompt_ids"][:5]
    seqs = [Seq(model, o["prompt_ids"], 32), Seq(model, _continuation_prompt(o), 32), Seq(model, short, 32)]
    drive(model, seqs, logits=True)
    assert seqs[0].tokens == o["greedy_tokens"]
    assert seqs[1].tokens == o["continuation"]["greedy_tokens"]
    assert seqs[2].tokens == alone(model, short, 32)
    assert_logits_close(np.stack(seqs[0].logits), o["logits"], exact=o["logits_f64"])
    # the same run through greedy_batch (argmax on the backend)
    again = [Seq(model, o["prompt_ids"], 32), Seq(model, _continuation_prompt(o), 32), Seq(model, short, 32)]
    drive(model, again)
    assert [s.tokens for s in again] == [s.tokens for s in seqs]


def test_sequences_joining_and_leaving_mid_run_keep_their_tokens(oracle_root):
    model, o = _oracle(oracle_root, "long-prompt")
    prompts = [o["prompt_ids"], _continuation_prompt(o), o["prompt_ids"][:11], o["prompt_ids"][3:20]]
    n_new = [32, 32, 9, 20]       # the short ones leave while the others run
    seqs = [Seq(model, p, n) for p, n in zip(prompts, n_new)]
    # the oracle prompt joins at step 4 (a prefill row beside decode rows), the last one at step 12
    drive(model, seqs, joins={0: 4, 1: 0, 2: 0, 3: 12})
    assert seqs[0].tokens == o["greedy_tokens"]
    assert seqs[1].tokens == o["continuation"]["greedy_tokens"]
    assert seqs[2].tokens == alone(model, prompts[2], 9)
    assert seqs[3].tokens == alone(model, prompts[3], 20)


def test_a_cancelled_sequence_leaves_the_others_unchanged(oracle_root):
    model, o = _oracle(oracle_root, "long-prompt")
    victim = o["prompt_ids"][5:30]
    seqs = [Seq(model, o["prompt_ids"], 32), Seq(model, victim, 32, chunk=6), Seq(model, _continuation_prompt(o), 32)]
    # cancelled once during its chunked prefill (step 2), a second time mid-decode in another run (step 9)
    drive(model, seqs, cancel_at={1: 2})
    assert seqs[0].tokens == o["greedy_tokens"]
    assert seqs[2].tokens == o["continuation"]["greedy_tokens"]
    assert seqs[1].tokens == [] and seqs[1].cache is None
    seqs = [Seq(model, o["prompt_ids"], 32), Seq(model, victim, 32), Seq(model, _continuation_prompt(o), 32)]
    drive(model, seqs, cancel_at={1: 9})
    assert seqs[0].tokens == o["greedy_tokens"]
    assert seqs[2].tokens == o["continuation"]["greedy_tokens"]
    assert seqs[1].tokens == alone(model, victim, 32)[:10]


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_a_chunked_prompt_gets_the_tokens_of_the_whole_prompt(oracle_root, chunk):
    model, o = _oracle(oracle_root, "long-prompt")
    # the chunked prompt crosses index_topk (8) mid-chunk; a decode row runs beside it all along
    seqs = [Seq(model, o["prompt_ids"], 32, chunk=chunk), Seq(model, o["prompt_ids"][:9], 40)]
    drive(model, seqs, logits=True)
    assert seqs[0].tokens == o["greedy_tokens"]
    assert seqs[1].tokens == alone(model, o["prompt_ids"][:9], 40)
    assert_logits_close(np.stack(seqs[0].logits), o["logits"], exact=o["logits_f64"])


def test_a_verification_row_gets_logits_for_every_position(oracle_root):
    model, o = _oracle(oracle_root, "long-prompt")
    p = o["prompt_ids"]
    teacher = BatchRow(model.new_cache(), p + o["greedy_tokens"][:-1], all_logits=True)
    other = BatchRow(model.new_cache(), p[:13])
    last = BatchRow(model.new_cache(), p[2:9], all_logits=False)
    out = forward_batch(model, [other, teacher, last])
    assert out[0].shape == (1, model.config.vocab_size) and out[2].shape == (1, model.config.vocab_size)
    assert out[1].shape == (len(p) + 31, model.config.vocab_size)
    assert_logits_close(out[1][len(p) - 1:], o["logits"], exact=o["logits_f64"])
    assert (teacher.cache.length, other.cache.length, last.cache.length) == (len(p) + 31, 13, 7)


class CountingExperts:
    """The model's real expert source, with every stream() call recorded as (layer, ids)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, list[int]]] = []

    def stream(self, layer, ids):
        self.calls.append((layer, list(ids)))
        return self.inner.stream(layer, ids)


def _prefilled(model, prompt, n_decode):
    """A cache holding prompt + its first n_decode greedy tokens fed, and the next token to feed."""
    cache = model.new_cache()
    tok = model.greedy(prompt, cache)
    for _ in range(n_decode):
        tok = model.greedy([tok], cache)
    return cache, tok


def test_the_union_of_the_steps_experts_is_asked_once_per_layer(oracle_root):
    model, o = _oracle(oracle_root, "long-prompt")
    c = model.config
    moe_layers = [i for i in range(c.num_hidden_layers) if c.mlp_layer_types[i] != "dense"]
    prompts = [o["prompt_ids"], _continuation_prompt(o), o["prompt_ids"][7:19]]
    counting = CountingExperts(model.experts)
    model.experts = counting

    def step_rows():       # two decode rows and a newcomer's prefill chunk
        (ca, ta), (cb, tb) = _prefilled(model, prompts[0], 3), _prefilled(model, prompts[1], 5)
        return [BatchRow(ca, [ta]), BatchRow(cb, [tb]), BatchRow(model.new_cache(), prompts[2])]

    alone_ids: dict[int, set] = {i: set() for i in moe_layers}
    alone_tokens = []
    alone_sizes = []
    for r in step_rows():
        counting.calls.clear()
        alone_tokens.append(model.greedy(r.ids, r.cache))
        assert [layer for layer, _ in counting.calls] == moe_layers
        for layer, ids in counting.calls:
            alone_ids[layer] |= set(ids)
            alone_sizes.append(len(ids))

    rows = step_rows()
    counting.calls.clear()
    assert greedy_batch(model, rows) == alone_tokens
    assert [layer for layer, _ in counting.calls] == moe_layers          # one stream() per MoE layer
    for layer, ids in counting.calls:
        assert ids == sorted(alone_ids[layer]), f"layer {layer}: the batch asked for {ids}"
    assert max(len(ids) for _, ids in counting.calls) > min(alone_sizes)  # the union is more than one row's


def test_bad_rows_are_refused_before_any_cache_moves(oracle_root):
    model, o = _oracle(oracle_root, "long-prompt")
    V = model.config.vocab_size
    a, b = model.new_cache(), model.new_cache()
    ta = model.greedy(o["prompt_ids"], a)
    with pytest.raises(ValueError, match="at least one row"):
        forward_batch(model, [])
    with pytest.raises(ValueError, match="batch row 1 has no new tokens"):
        forward_batch(model, [BatchRow(a, [ta]), BatchRow(b, [])])
    with pytest.raises(ValueError, match=rf"batch row 1: token id {V} is outside the vocabulary"):
        greedy_batch(model, [BatchRow(a, [ta]), BatchRow(b, [3, V, 4])])
    with pytest.raises(ValueError, match=r"batch row 1: token id -2"):
        greedy_batch(model, [BatchRow(a, [ta]), BatchRow(b, [-2])])
    with pytest.raises(ValueError, match="batch rows 0 and 1 share one KV cache"):
        greedy_batch(model, [BatchRow(a, [ta]), BatchRow(a, [ta])])
    assert (a.length, b.length) == (len(o["prompt_ids"]), 0)
    # the good row, stepped after the refusals, continues exactly
    toks = [ta]
    for _ in range(31):
        toks.append(greedy_batch(model, [BatchRow(a, [toks[-1]])])[0])
    assert toks == o["greedy_tokens"]


class FailingOnce:
    """The model's real expert source, failing its first stream() of `layer` (as a lost RAM-tier read would)."""

    def __init__(self, inner, layer):
        self.inner, self.layer, self.failed = inner, layer, False

    def stream(self, layer, ids):
        if layer == self.layer and not self.failed:
            self.failed = True
            raise OSError(f"injected read failure at layer {layer}")
        return self.inner.stream(layer, ids)


def test_a_step_that_fails_midway_leaves_every_cache_where_it_was(oracle_root):
    model, o = _oracle(oracle_root, "long-prompt")
    p, cont = o["prompt_ids"], _continuation_prompt(o)
    a, b = model.new_cache(8), model.new_cache(8)
    first = greedy_batch(model, [BatchRow(a, p), BatchRow(b, cont)])
    real = model.experts
    model.experts = FailingOnce(real, model.config.moe_layers[-1])     # after every cache write of the step
    with pytest.raises(OSError, match="injected"):
        greedy_batch(model, [BatchRow(a, [first[0]]), BatchRow(b, [first[1]]), BatchRow(model.new_cache(), p[:6])])
    model.experts = real
    assert (a.length, b.length) == (len(p), len(cont))
    toks = [[first[0]], [first[1]]]
    for _ in range(31):
        nxt = greedy_batch(model, [BatchRow(a, [toks[0][-1]]), BatchRow(b, [toks[1][-1]])])
        for t, n in zip(toks, nxt):
            t.append(n)
    assert toks == [o["greedy_tokens"], o["continuation"]["greedy_tokens"]]


def test_hooks_see_the_whole_step_in_row_order(oracle_root):
    model, o = _oracle(oracle_root, "long-prompt")
    prompts = [o["prompt_ids"][:9], o["prompt_ids"], o["prompt_ids"][4:7]]
    seen: dict[int, list[np.ndarray]] = {}
    model.routing_hook = lambda layer, idx, w: seen.setdefault(layer, []).append(np.sort(idx, axis=-1))
    try:
        for p in prompts:                                  # each alone: one hook call per MoE layer
            model.forward(p, model.new_cache())
        alone = {layer: np.concatenate(calls) for layer, calls in seen.items()}
        seen.clear()
        forward_batch(model, [BatchRow(model.new_cache(), p) for p in prompts])
    finally:
        model.routing_hook = None
    assert sorted(seen) == model.config.moe_layers
    for layer, calls in seen.items():
        assert len(calls) == 1 and calls[0].shape[0] == sum(len(p) for p in prompts)
        np.testing.assert_array_equal(calls[0], alone[layer])   # [S_total, K]: the rows' choices, in row order
