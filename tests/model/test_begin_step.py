"""The expert source hears when a forward step begins and over how many rows (coli/model/forward.py begin_step): the
VRAM cache starts a long prefill's first MoE layer's copies there (coli/gpu/layer_ahead.py first_ahead). Real model
(an oracle container on the numpy path), its real expert source wrapped to record the calls."""

from __future__ import annotations

from coli.loader import load_model
from coli.model.batch import BatchRow, greedy_batch
from oracles import load_oracle, oracle_dir


class HookedExperts:
    """The model's real expert source; every begin_step(tokens) and stream(layer, ids) call recorded in order."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple] = []

    def begin_step(self, tokens):
        self.calls.append(("begin", tokens))

    def stream(self, layer, ids):
        self.calls.append(("stream", layer))
        return self.inner.stream(layer, ids)


def _model(tmp_path):
    d = oracle_dir(tmp_path, "long-prompt")
    model, _ = load_model(d)
    return model, load_oracle(d)


def test_every_step_announces_its_rows_before_its_first_layer_asks_for_experts(tmp_path):
    model, o = _model(tmp_path)
    c = model.config
    moe = [i for i in range(c.num_hidden_layers) if c.mlp_layer_types[i] != "dense"]
    hooked = HookedExperts(model.experts)
    model.experts = hooked
    prompt = o["prompt_ids"]
    cache = model.new_cache()
    tok = model.greedy(prompt, cache)                                  # the prefill: one forward over the prompt
    model.greedy([tok], cache)                                         # a decode step
    one = [("begin", len(prompt))] + [("stream", i) for i in moe]
    assert hooked.calls == one + [("begin", 1)] + [("stream", i) for i in moe]

    # a batched step: one announcement of every row of the step (the union of their experts is asked once a layer)
    hooked.calls.clear()
    rows = [BatchRow(cache, [tok]), BatchRow(model.new_cache(), prompt[:9])]
    greedy_batch(model, rows)
    assert hooked.calls == [("begin", 10)] + [("stream", i) for i in moe]


def test_a_source_without_the_hook_serves_as_before(tmp_path):
    model, o = _model(tmp_path)
    assert not hasattr(model.experts, "begin_step")                   # WeightExperts: nothing to start
    plain = model.greedy(o["prompt_ids"], model.new_cache())
    model.experts = HookedExperts(model.experts)
    assert model.greedy(o["prompt_ids"], model.new_cache()) == plain
