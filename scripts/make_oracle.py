#!/usr/bin/env python3
"""Build a tiny random GLM-5 (``glm_moe_dsa``) model and transformers' reference ("oracle") outputs.

The oracle is what ColiStream's own engine is tested against for token-exact agreement, so it is built to be
*safe*: every top-k decision taken while producing it (DSA indexer selection, MoE routing, group routing, greedy
argmax) is checked to have a clear margin, so that the reference itself is not ambiguous. See
``shared/reference/glm5.md`` §6 and §8 for the background.

Usage
-----
    .venv/bin/python scripts/make_oracle.py --out DIR [--seed N] [--layers L] [--dense-layers D]
        [--experts E] [--topk K] [--index-topk T] [--indexer-pattern FSFS] [--n-group G --topk-group g]
        [--prompt-len P] [--new-tokens N] [--continue-tokens C] [--vocab V] [--hidden H] [--force]
        [--no-safety-check]

Exit status: 0 on success, 1 when the oracle is unsafe (the reason is printed, nothing is left behind),
2 for invalid arguments or an existing DIR without ``--force``.

Importable too (``sys.path.insert(0, "scripts"); import make_oracle``)::

    info = make_oracle.build_oracle(out_dir, seed=3, ...)   # returns the oracle.json content
    # raises make_oracle.OracleUnsafe(reason) when a safety check fails,
    # ValueError for invalid options, FileExistsError if out_dir exists and force is False.

What gets built
---------------
Tiny config (reference §8): vocab 512, hidden 128, 4 layers (``first_k_dense_replace`` = 1 -> 1 dense + 3 MoE),
4 attention heads (4 kv heads), q_lora_rank 64, kv_lora_rank 32, qk_nope 32 / qk_rope 16 / v_head 32,
16 routed experts top-4, 1 shared expert, moe_intermediate_size 64, intermediate_size 256, indexer 32 heads x 32
dims, index_topk 8, rope default with theta 1e6, n_group 1 / topk_group 1, routed_scaling_factor 2.5,
norm_topk_prob True, rms_norm_eps 1e-5, bos 0, eos 1, pad None, untied lm_head, max_position_embeddings 4096,
fp32, default attention implementation (sdpa) and default experts implementation.
``--indexer-pattern`` sets ``indexer_types`` (F = full, S = shared; layer 0 must be F).

Randomisation (reference §6.12), all from ``torch.manual_seed(seed)`` in this order: transformers' own init of
the model, then (in ``named_modules`` order) every RMSNorm weight (input / post-attention / final / q_a / kv_a) ->
1 + N(0, 0.1); every indexer ``k_norm`` LayerNorm weight -> 1 + N(0, 0.1) and bias -> N(0, 0.1); every router
``weight`` -> N(0, ROUTER_INIT_STD = 0.1) (**widened** from transformers' initializer_range 0.02 to reduce natural
router near-ties: the router input is an RMS-normalised vector of norm ~sqrt(hidden), so with 0.02 the router logits
have std ~0.23 and the sigmoid scores sit at 0.5 +- 0.06; with 0.1 the logits have std ~1.1 and the scores spread
to 0.5 +- 0.2. Measured on seeds 1-8 of the default config, this raised the median smallest top-K router gap from
~7e-5 to ~3e-4); every ``e_score_correction_bias`` -> N(0, 0.05). Everything else keeps transformers'
init (N(0, 0.02) linears/experts/embeddings). The model stays fp32.

Prompt: BOS 0 followed by ``prompt_len - 1`` ids drawn uniformly from [2, vocab) by ``numpy.random.default_rng(seed)``;
the continuation's ``continue_tokens`` extra ids are drawn next from the same generator.

Runs (all greedy, fp32, ``attention_mask`` = ones, ``eos_token_id=None``, ``min_new_tokens=None``, pad = an id
that does not occur in the input, raw logits via ``output_logits``):
  1. ``generate(prompt, max_new_tokens=new_tokens)`` -> ``greedy_tokens`` and ``oracle_logits.npy``.
  2. ``generate(prompt + greedy_tokens + extra_ids, max_new_tokens=new_tokens)`` (a fresh call on the
     concatenation) -> ``continuation.greedy_tokens`` and ``continuation_logits.npy``. An engine that keeps its KV
     cache from run 1 and only prefills ``[greedy_tokens[-1]] + extra_ids`` must reproduce it.

Safety checks (reference §6.1-6.2). Forward hooks on every ``GlmMoeDsaIndexer`` and ``GlmMoeDsaTopkRouter``
recompute, in fp32 and with transformers' own ops, the indexer ``index_scores`` and the router
``scores_for_choice`` (after group masking) of every call made during runs 1 and 2 and during the no-cache
re-forwards of check 5, and verify that the recomputed top-k sets equal the ones transformers used. Then:
  1. indexer: for every query row with more visible (causal) keys than index_topk, the gap between the k-th and
     (k+1)-th largest visible score, relative to the row's max |score|, must be > 1e-5 (so no ties either);
  2. router: for every token row the gap between the K-th and (K+1)-th ``scores_for_choice`` must be > 1e-5;
  3. group routing (n_group > topk_group): the gap between the topk_group-th and next group score must be > 1e-5;
  4. every generated step's top-1 minus top-2 raw logit must be > 1e-4;
  5. a no-cache full forward over each run's whole sequence must give the same argmax at every generated step
     and logits within 1e-4 of the cached generation;
  6. the saved files, reloaded with ``from_pretrained``, must reproduce the same argmax and logits within 1e-4.
Check names: indexer_rel_gap, router_gap, group_gap, logit_margin, cache_nocache, reload (plus
indexer_selection_recompute / router_selection_recompute, which would mean the probe itself is out of step with
transformers). Runs: generate, continuation, nocache_generate, nocache_continuation.
Any failure raises ``OracleUnsafe`` naming the check, run, layer and position (unless ``check_safety=False``, in
which case the oracle is written with ``"oracle_safe": false`` and the failures listed under ``safety``).

Outputs in DIR (written into a temporary directory beside DIR, renamed into place only when complete):
  config.json, generation_config.json, model.safetensors (as ``save_pretrained`` writes them; routed experts are
  stored per expert on disk), oracle.json, oracle_logits.npy (float32 [new_tokens, vocab]),
  oracle_logits_f64.npy (the same steps teacher-forced in float64, [new_tokens, vocab]) and
  continuation_logits.npy (float32 [new_tokens, vocab]).

oracle.json::

    {"seed": int,
     "options": {seed, layers, dense_layers, experts, topk, index_topk, indexer_pattern (resolved, e.g. "FFFF"),
                 n_group, topk_group, prompt_len, new_tokens, continue_tokens, vocab, hidden},
     "prompt_ids": [...], "greedy_tokens": [...],
     "continuation": {"extra_ids": [...], "greedy_tokens": [...]},
     "pad_token_ids": {"generate": int, "continuation": int},
     "randomization": {...the init recipe above...},
     "safety": {"min_indexer_rel_gap", "min_router_gap", "min_group_gap" (null without group routing),
                "min_logit_margin", "cache_nocache_max_logit_diff", "reload_max_logit_diff",
                "sparse_rows" (indexer query rows of runs 1+2, summed over full-indexer layers, that had more
                               visible keys than index_topk, i.e. really selected),
                "indexer_rows", "router_rows" (rows looked at, all runs), "worst" ({check: location of its minimum}),
                "thresholds": {...}, "n_failures": int,
                "failures": [{"check", "value", "threshold", "run", "layer"|"step", "position", ...}] (first 20)},
     "oracle_safe": bool, "transformers_version": str, "torch_version": str}

Minima are ``null`` when the check had nothing to look at (e.g. no MoE layer, or experts == topk).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import transformers
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as _glm
from transformers.utils import logging as _hf_logging

__all__ = ["OracleUnsafe", "build_oracle", "main", "DEFAULTS", "THRESHOLDS"]

# ----------------------------------------------------------------------------------------------------------------
# constants

DEFAULTS: dict = dict(
    seed=3,  # 1234 (the first choice) is unsafe: indexer boundary gap 6e-7, logit margins < 1e-4
    layers=4,
    dense_layers=1,
    experts=16,
    topk=4,
    index_topk=8,
    indexer_pattern=None,
    n_group=1,
    topk_group=1,
    prompt_len=20,
    new_tokens=32,
    continue_tokens=6,
    vocab=512,
    hidden=128,
)

THRESHOLDS: dict = dict(
    indexer_rel_gap=1e-5,
    router_gap=1e-5,
    group_gap=1e-5,
    logit_margin=1e-4,
    cache_nocache_logit_diff=1e-4,
    reload_logit_diff=1e-4,
)

NORM_STD = 0.1  # RMSNorm / indexer k_norm weights: 1 + N(0, NORM_STD)
K_NORM_BIAS_STD = 0.1  # indexer k_norm bias: N(0, K_NORM_BIAS_STD)
ROUTER_INIT_STD = 0.1  # router weight: N(0, ROUTER_INIT_STD) (transformers would use initializer_range = 0.02)
CORRECTION_BIAS_STD = 0.05  # e_score_correction_bias: N(0, CORRECTION_BIAS_STD)

MAX_POSITIONS = 4096
_MAX_LISTED_FAILURES = 20


class OracleUnsafe(Exception):
    """The reference would be ambiguous (a near-tie somewhere): do not use it for token-exact tests."""

    def __init__(self, reason: str, failures: list | None = None):
        super().__init__(reason)
        self.reason = reason
        self.failures = list(failures or [])


# ----------------------------------------------------------------------------------------------------------------
# options


def _resolve_options(opts: dict) -> dict:
    """Validate the build options; return them with ``indexer_pattern`` resolved. Raises ValueError."""
    o = dict(opts)
    for name in ("seed", "layers", "dense_layers", "experts", "topk", "index_topk", "n_group", "topk_group",
                 "prompt_len", "new_tokens", "continue_tokens", "vocab", "hidden"):
        v = o[name]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {v!r}")
        o[name] = int(v)
    errors = []
    if o["seed"] < 0:
        errors.append("seed must be >= 0")
    if o["layers"] < 1:
        errors.append("layers must be >= 1")
    if not 0 <= o["dense_layers"] <= o["layers"]:
        errors.append(f"dense_layers must be in [0, layers={o['layers']}]")
    if o["experts"] < 1:
        errors.append("experts must be >= 1")
    if not 1 <= o["topk"] <= o["experts"]:
        errors.append(f"topk must be in [1, experts={o['experts']}]")
    if o["n_group"] < 1 or o["experts"] % o["n_group"] != 0:
        errors.append(f"experts ({o['experts']}) must be divisible by n_group ({o['n_group']})")
    elif o["experts"] // o["n_group"] < 2:
        errors.append("each expert group needs at least 2 experts (group score = sum of its top-2)")
    if not 1 <= o["topk_group"] <= o["n_group"]:
        errors.append(f"topk_group must be in [1, n_group={o['n_group']}]")
    elif o["n_group"] >= 1 and o["experts"] % o["n_group"] == 0 and \
            o["topk"] > o["topk_group"] * (o["experts"] // o["n_group"]):
        errors.append("topk exceeds the number of experts in the topk_group selected groups")
    if o["index_topk"] < 1:
        errors.append("index_topk must be >= 1")
    if o["prompt_len"] <= o["index_topk"]:
        errors.append(f"prompt_len ({o['prompt_len']}) must be > index_topk ({o['index_topk']}) so that the "
                      "sparse attention really selects")
    if o["new_tokens"] < 1:
        errors.append("new_tokens must be >= 1")
    if o["continue_tokens"] < 0:
        errors.append("continue_tokens must be >= 0")
    if o["vocab"] < 3:
        errors.append("vocab must be >= 3 (ids 0 and 1 are BOS/EOS, prompt ids are drawn from [2, vocab))")
    if o["hidden"] < 1:
        errors.append("hidden must be >= 1")
    total = o["prompt_len"] + 2 * o["new_tokens"] + o["continue_tokens"]
    if total > MAX_POSITIONS:
        errors.append(f"prompt_len + 2*new_tokens + continue_tokens = {total} exceeds {MAX_POSITIONS} positions")

    pat = o.get("indexer_pattern")
    if pat is None:
        pat = "F" * o["layers"]
    if not isinstance(pat, str):
        errors.append(f"indexer_pattern must be a string of F/S, got {pat!r}")
    else:
        pat = pat.upper()
        if len(pat) != o["layers"]:
            errors.append(f"indexer_pattern {pat!r} has {len(pat)} letters, expected layers={o['layers']}")
        elif set(pat) - {"F", "S"}:
            errors.append(f"indexer_pattern {pat!r} may only contain F (full) and S (shared)")
        elif pat[0] != "F":
            errors.append(f"indexer_pattern {pat!r}: layer 0 must be F (a shared layer needs a previous full one)")
    o["indexer_pattern"] = pat
    if errors:
        raise ValueError("; ".join(errors))
    return o


def _make_config(o: dict) -> GlmMoeDsaConfig:
    return GlmMoeDsaConfig(
        vocab_size=o["vocab"],
        hidden_size=o["hidden"],
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=o["layers"],
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=o["experts"],
        num_experts_per_tok=o["topk"],
        n_group=o["n_group"],
        topk_group=o["topk_group"],
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=32,
        index_head_dim=32,
        index_topk=o["index_topk"],
        indexer_types=[{"F": "full", "S": "shared"}[c] for c in o["indexer_pattern"]],
        first_k_dense_replace=o["dense_layers"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        tie_word_embeddings=False,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.02,
    )


@torch.no_grad()
def _build_model(o: dict) -> GlmMoeDsaForCausalLM:
    torch.manual_seed(o["seed"])
    model = GlmMoeDsaForCausalLM(_make_config(o))
    model = model.to(torch.float32)
    for _, mod in model.named_modules():
        if isinstance(mod, _glm.GlmMoeDsaRMSNorm):
            mod.weight.copy_(1.0 + NORM_STD * torch.randn_like(mod.weight))
        elif isinstance(mod, _glm.GlmMoeDsaIndexer):
            mod.k_norm.weight.copy_(1.0 + NORM_STD * torch.randn_like(mod.k_norm.weight))
            mod.k_norm.bias.copy_(K_NORM_BIAS_STD * torch.randn_like(mod.k_norm.bias))
        elif isinstance(mod, _glm.GlmMoeDsaTopkRouter):
            mod.weight.copy_(ROUTER_INIT_STD * torch.randn_like(mod.weight))
            mod.e_score_correction_bias.copy_(CORRECTION_BIAS_STD * torch.randn_like(mod.e_score_correction_bias))
    model.eval()
    return model


# ----------------------------------------------------------------------------------------------------------------
# safety probe


class _Probe:
    """Forward hooks recomputing indexer / router top-k margins for every call while ``self.run`` is set."""

    def __init__(self, model: GlmMoeDsaForCausalLM, index_topk: int):
        self.index_topk = index_topk
        self.run: str | None = None
        self.positions: torch.Tensor | None = None  # absolute positions of the current call's query rows
        self.layer: int | None = None
        self.mins: dict = {}  # check -> (value, location dict)
        self.failures: list = []
        self.n_failures = 0
        self.rows = {"indexer": 0, "router": 0}
        self.sparse_rows: dict = {}  # run -> count
        self._handles = []
        for idx, layer in enumerate(model.model.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_pre_hook(idx), with_kwargs=True))
            attn = layer.self_attn
            if attn.indexer is not None:
                self._handles.append(attn.indexer.register_forward_hook(self._indexer_hook, with_kwargs=True))
            if isinstance(layer.mlp, _glm.GlmMoeDsaMoE):
                self._handles.append(layer.mlp.gate.register_forward_hook(self._router_hook, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- bookkeeping

    def _record(self, check: str, values: torch.Tensor, threshold: float, describe) -> None:
        """values: 1-D tensor (one per checked row); describe(i) -> location dict of row i."""
        if values.numel() == 0:
            return
        values = values.double()
        i = int(torch.argmin(values))
        v = float(values[i])
        if check not in self.mins or v < self.mins[check][0]:
            self.mins[check] = (v, describe(i))
        bad = torch.nonzero(~(values > threshold)).flatten().tolist()  # also catches NaN
        for j in bad:
            self._fail(check, float(values[j]), threshold, describe(j))

    def _fail(self, check: str, value: float | None, threshold: float | None, where: dict) -> None:
        self.n_failures += 1
        if value is not None and not math.isfinite(value):
            value = None  # keep oracle.json strict JSON (no NaN / Infinity)
        if len(self.failures) < _MAX_LISTED_FAILURES:
            self.failures.append({"check": check, "value": value, "threshold": threshold, **where})

    def _where(self, row: int, layer: int | None = None) -> dict:
        pos = int(self.positions[row]) if self.positions is not None and row < self.positions.numel() else None
        return {"run": self.run, "layer": self.layer if layer is None else layer, "position": pos}

    # -- hooks

    def _layer_pre_hook(self, idx: int):
        def hook(module, args, kwargs):
            self.layer = idx
            pos = kwargs.get("position_ids")
            self.positions = None if pos is None else pos.reshape(-1).detach().clone()
        return hook

    @torch.no_grad()
    def _indexer_hook(self, m, args, kwargs, output):
        if self.run is None:
            return
        names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
        a = dict(zip(names, args))
        a.update({k: v for k, v in kwargs.items() if k in names})
        hs, q_resid, (cos, sin), mask = a["hidden_states"], a["q_resid"], a["position_embeddings"], a["attention_mask"]
        pkv = kwargs.get("past_key_values")
        if hs.shape[0] != 1:
            raise RuntimeError("the oracle probe handles batch size 1 only")
        bsz, seq, _ = hs.shape
        # Same ops as GlmMoeDsaIndexer.forward (transformers 5.23).
        q = m.wq_b(q_resid).view(bsz, seq, m.n_heads, m.head_dim)
        q_rot, q_pass = torch.split(q, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
        k = m.k_norm(m.wk(hs)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = _glm.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        if pkv is not None:
            keys = pkv.layers[m.layer_idx].indexer_keys  # already updated by the forward: past + current
            if keys.shape[1] < seq or not torch.equal(keys[:, -seq:], k):
                raise RuntimeError(f"probe: cached indexer keys of layer {m.layer_idx} do not end with this call's keys")
        else:
            keys = k
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * m.softmax_scale)
        weights = m.weights_proj(hs.to(m.weights_proj.weight.dtype)).float() * (m.n_heads ** -0.5)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]  # [S, T]
        visible = mask[0] if mask.dtype == torch.bool else (mask[0] == 0)  # [S, T]
        visible = visible.expand_as(index_scores)
        n_vis = visible.sum(-1)
        k_sel = self.index_topk
        sel_rows = torch.nonzero(n_vis > k_sel).flatten()
        self.rows["indexer"] += seq
        if sel_rows.numel() == 0:
            return
        if self.run in ("generate", "continuation"):
            self.sparse_rows[self.run] = self.sparse_rows.get(self.run, 0) + int(sel_rows.numel())
        s = index_scores[sel_rows].masked_fill(~visible[sel_rows], float("-inf"))
        srt = torch.sort(s, dim=-1, descending=True).values
        gap = srt[:, k_sel - 1] - srt[:, k_sel]
        scale = s.masked_fill(~visible[sel_rows], 0.0).abs().amax(-1)
        rel = torch.where(scale > 0, gap / scale.clamp_min(1e-30), torch.zeros_like(gap))
        rel = torch.where(torch.isfinite(rel), rel, torch.zeros_like(rel))
        rows = sel_rows.tolist()
        self._record("indexer_rel_gap", rel, THRESHOLDS["indexer_rel_gap"], lambda i: self._where(rows[i], m.layer_idx))
        # the recomputed selection must be the one transformers used (visible part of it)
        ours = torch.topk(s, k_sel, dim=-1).indices.sort(-1).values
        theirs = output[0][sel_rows].long()
        theirs_vis = torch.gather(visible[sel_rows], 1, theirs)
        theirs = torch.where(theirs_vis, theirs, torch.full_like(theirs, -1)).sort(-1).values
        for i in torch.nonzero((ours != theirs).any(-1)).flatten().tolist():
            self._fail("indexer_selection_recompute", None, None, self._where(rows[i], m.layer_idx))

    @torch.no_grad()
    def _router_hook(self, m, args, kwargs, output):
        if self.run is None:
            return
        hs = (args[0] if args else kwargs["hidden_states"]).reshape(-1, m.hidden_dim)
        # Same ops as GlmMoeDsaTopkRouter.forward (transformers 5.23).
        scores = F.linear(hs.type(torch.float32), m.weight.type(torch.float32)).sigmoid()
        sfc = scores + m.e_score_correction_bias
        n_rows = sfc.shape[0]
        per = m.num_experts // m.num_group
        group_scores = sfc.view(-1, m.num_group, per).topk(2, dim=-1)[0].sum(dim=-1)
        if m.topk_group < m.num_group:
            gs = torch.sort(group_scores, dim=-1, descending=True).values
            self._record("group_gap", gs[:, m.topk_group - 1] - gs[:, m.topk_group], THRESHOLDS["group_gap"],
                         self._where)
        group_idx = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, m.num_group, per).reshape(-1, m.num_experts)
        sfc = sfc.masked_fill(~score_mask.bool(), float("-inf"))
        self.rows["router"] += n_rows
        if m.top_k < m.topk_group * per:
            srt = torch.sort(sfc, dim=-1, descending=True).values
            self._record("router_gap", srt[:, m.top_k - 1] - srt[:, m.top_k], THRESHOLDS["router_gap"], self._where)
        ours = torch.topk(sfc, k=m.top_k, dim=-1, sorted=False)[1].sort(-1).values
        theirs = output[2].long().sort(-1).values
        for i in torch.nonzero((ours != theirs).any(-1)).flatten().tolist():
            self._fail("router_selection_recompute", None, None, self._where(i))


# ----------------------------------------------------------------------------------------------------------------
# runs


def _pad_id(seq: list, vocab: int) -> int:
    used = set(int(t) for t in seq)
    for cand in range(vocab - 1, 1, -1):
        if cand not in used:
            return cand
    return vocab - 1  # every id is used: irrelevant anyway, an explicit attention_mask is always passed


@torch.no_grad()
def _generate(model, ids: list, new_tokens: int, vocab: int) -> tuple[list, np.ndarray, int]:
    input_ids = torch.tensor([ids], dtype=torch.long)
    pad = _pad_id(ids, vocab)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=None,
        eos_token_id=None,
        pad_token_id=pad,
        output_logits=True,
        return_dict_in_generate=True,
    )
    seq = out.sequences[0].tolist()
    if seq[: len(ids)] != ids or len(seq) != len(ids) + new_tokens or len(out.logits) != new_tokens:
        raise RuntimeError("generate() did not return exactly the prompt followed by new_tokens tokens")
    logits = torch.stack([lg[0] for lg in out.logits]).float().numpy().astype(np.float32)
    return seq[len(ids):], logits, pad


@torch.no_grad()
def _full_forward(model, ids: list, dtype=np.float32) -> np.ndarray:
    input_ids = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    return out.logits[0].double().numpy().astype(dtype)


def _margins(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits.astype(np.float64), axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def _fmt_failure(f: dict) -> str:
    where = ", ".join(f"{k} {f[k]}" for k in ("run", "layer", "position", "step") if f.get(k) is not None)
    text = f"{f['check']} at {where}"
    value = f.get("value")
    if value is not None:
        text += f": value {value:.3e}"
    if f.get("threshold") is not None:
        text += f" (threshold {f['threshold']:g})"
    if f.get("argmax") is not None:
        text += f", argmax {f['argmax']} vs reference {f['reference']}"
    return text


def _none_if_missing(mins: dict, key: str):
    return None if key not in mins else float(mins[key][0])


# ----------------------------------------------------------------------------------------------------------------
# public API


def build_oracle(out_dir, *, seed=DEFAULTS["seed"], layers=DEFAULTS["layers"], dense_layers=DEFAULTS["dense_layers"],
                 experts=DEFAULTS["experts"], topk=DEFAULTS["topk"], index_topk=DEFAULTS["index_topk"],
                 indexer_pattern=DEFAULTS["indexer_pattern"], n_group=DEFAULTS["n_group"],
                 topk_group=DEFAULTS["topk_group"], prompt_len=DEFAULTS["prompt_len"],
                 new_tokens=DEFAULTS["new_tokens"], continue_tokens=DEFAULTS["continue_tokens"],
                 vocab=DEFAULTS["vocab"], hidden=DEFAULTS["hidden"], check_safety=True, force=False) -> dict:
    """Build the tiny model + reference outputs into ``out_dir``; return the oracle.json content.

    Raises ValueError (invalid options), FileExistsError (``out_dir`` exists and not ``force``) or OracleUnsafe
    (a safety check failed and ``check_safety``). Nothing is left at ``out_dir`` unless the build succeeded; an
    existing ``out_dir`` is replaced (with ``force``) only after a successful build.
    """
    o = _resolve_options(dict(seed=seed, layers=layers, dense_layers=dense_layers, experts=experts, topk=topk,
                              index_topk=index_topk, indexer_pattern=indexer_pattern, n_group=n_group,
                              topk_group=topk_group, prompt_len=prompt_len, new_tokens=new_tokens,
                              continue_tokens=continue_tokens, vocab=vocab, hidden=hidden))
    out_dir = Path(out_dir)
    if (out_dir.exists() or out_dir.is_symlink()) and not force:
        raise FileExistsError(f"{out_dir} already exists (use --force / force=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small model: 1 thread is as fast, and makes the results independent of the host
    bars = _hf_logging.is_progress_bar_enabled()
    _hf_logging.disable_progress_bar()  # no "Writing model shards" / "Loading weights" bars
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the final DIR gets ordinary permissions
        info = _build_into(tmp, o, check_safety)
        if out_dir.exists() or out_dir.is_symlink():
            if out_dir.is_dir() and not out_dir.is_symlink():
                shutil.rmtree(out_dir)
            else:
                out_dir.unlink()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(old_threads)
        if bars:
            _hf_logging.enable_progress_bar()
    return info


def _build_into(tmp: Path, o: dict, check_safety: bool) -> dict:
    rng = np.random.default_rng(o["seed"])
    prompt = [0] + [int(x) for x in rng.integers(2, o["vocab"], size=o["prompt_len"] - 1)]
    extra = [int(x) for x in rng.integers(2, o["vocab"], size=o["continue_tokens"])]

    model = _build_model(o)
    probe = _Probe(model, o["index_topk"])
    try:
        probe.run = "generate"
        gen, gen_logits, pad1 = _generate(model, prompt, o["new_tokens"], o["vocab"])
        cont_input = prompt + gen + extra
        probe.run = "continuation"
        cont, cont_logits, pad2 = _generate(model, cont_input, o["new_tokens"], o["vocab"])
        probe.run = "nocache_generate"
        full1 = prompt + gen[:-1]
        nc1 = _full_forward(model, full1)[len(prompt) - 1:]
        probe.run = "nocache_continuation"
        full2 = cont_input + cont[:-1]
        nc2 = _full_forward(model, full2)[len(cont_input) - 1:]
    finally:
        probe.run = None
        probe.remove()

    # logit margins
    for run, logits in (("generate", gen_logits), ("continuation", cont_logits)):
        m = _margins(logits)
        i = int(np.argmin(m))
        if "logit_margin" not in probe.mins or m[i] < probe.mins["logit_margin"][0]:
            start = len(prompt) if run == "generate" else len(cont_input)
            probe.mins["logit_margin"] = (float(m[i]), {"run": run, "step": i, "position": start + i})
        for j in np.nonzero(~(m > THRESHOLDS["logit_margin"]))[0]:
            start = len(prompt) if run == "generate" else len(cont_input)
            probe._fail("logit_margin", float(m[j]), THRESHOLDS["logit_margin"],
                        {"run": run, "step": int(j), "position": start + int(j)})

    # cache vs no-cache
    def compare(check, run, ref_logits, ref_tokens, other, start, threshold):
        diff = np.abs(other.astype(np.float64) - ref_logits.astype(np.float64)).max(-1)
        arg = other.argmax(-1)
        for j in range(len(ref_tokens)):
            if int(arg[j]) != int(ref_tokens[j]) or not diff[j] <= threshold:
                probe._fail(check, float(diff[j]), threshold,
                            {"run": run, "step": j, "position": start + j,
                             "argmax": int(arg[j]), "reference": int(ref_tokens[j])})
        return float(diff.max())

    nc_diff = max(
        compare("cache_nocache", "generate", gen_logits, gen, nc1, len(prompt),
                THRESHOLDS["cache_nocache_logit_diff"]),
        compare("cache_nocache", "continuation", cont_logits, cont, nc2, len(cont_input),
                THRESHOLDS["cache_nocache_logit_diff"]),
    )

    # save, reload, re-check
    model.save_pretrained(tmp)
    del model
    reloaded = GlmMoeDsaForCausalLM.from_pretrained(tmp)
    reloaded.eval()
    reload_diff = max(
        compare("reload", "generate", gen_logits, gen, _full_forward(reloaded, full1)[len(prompt) - 1:],
                len(prompt), THRESHOLDS["reload_logit_diff"]),
        compare("reload", "continuation", cont_logits, cont, _full_forward(reloaded, full2)[len(cont_input) - 1:],
                len(cont_input), THRESHOLDS["reload_logit_diff"]),
    )
    del reloaded
    # The generate run's logits once more in float64 (eager kernels: grouped_mm has no float64): the tests bound
    # the engine's float32 error from these by transformers' own float32 error (tests/oracles.py)
    exact = GlmMoeDsaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float64, experts_implementation="eager",
                                                 attn_implementation="eager")
    exact.eval()
    gen_logits64 = _full_forward(exact, full1, np.float64)[len(prompt) - 1:]
    del exact

    safe = probe.n_failures == 0
    safety = {
        "min_indexer_rel_gap": _none_if_missing(probe.mins, "indexer_rel_gap"),
        "min_router_gap": _none_if_missing(probe.mins, "router_gap"),
        "min_group_gap": _none_if_missing(probe.mins, "group_gap"),
        "min_logit_margin": _none_if_missing(probe.mins, "logit_margin"),
        "cache_nocache_max_logit_diff": nc_diff,
        "reload_max_logit_diff": reload_diff,
        "sparse_rows": int(probe.sparse_rows.get("generate", 0) + probe.sparse_rows.get("continuation", 0)),
        "indexer_rows": int(probe.rows["indexer"]),
        "router_rows": int(probe.rows["router"]),
        "worst": {k: v[1] for k, v in sorted(probe.mins.items())},
        "thresholds": dict(THRESHOLDS),
        "n_failures": int(probe.n_failures),
        "failures": probe.failures,
    }
    if check_safety and not safe:
        shown = "; ".join(_fmt_failure(f) for f in probe.failures[:5])
        more = f" (+{probe.n_failures - 5} more)" if probe.n_failures > 5 else ""
        raise OracleUnsafe(f"oracle unsafe (seed {o['seed']}): {shown}{more}", probe.failures)

    info = {
        "seed": o["seed"],
        "options": o,
        "prompt_ids": prompt,
        "greedy_tokens": [int(t) for t in gen],
        "continuation": {"extra_ids": extra, "greedy_tokens": [int(t) for t in cont]},
        "pad_token_ids": {"generate": pad1, "continuation": pad2},
        "randomization": {
            "norm_weight": f"1 + N(0, {NORM_STD})",
            "k_norm_weight": f"1 + N(0, {NORM_STD})",
            "k_norm_bias": f"N(0, {K_NORM_BIAS_STD})",
            "router_weight": f"N(0, {ROUTER_INIT_STD})",
            "e_score_correction_bias": f"N(0, {CORRECTION_BIAS_STD})",
            "other": "transformers init, initializer_range 0.02",
        },
        "safety": safety,
        "oracle_safe": safe,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    np.save(tmp / "oracle_logits.npy", gen_logits.astype(np.float32))
    np.save(tmp / "oracle_logits_f64.npy", gen_logits64)
    np.save(tmp / "continuation_logits.npy", cont_logits.astype(np.float32))
    with open(tmp / "oracle.json", "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    return info


# ----------------------------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULTS
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--layers", type=int, default=d["layers"])
    p.add_argument("--dense-layers", type=int, default=d["dense_layers"], help="first_k_dense_replace")
    p.add_argument("--experts", type=int, default=d["experts"], help="routed experts")
    p.add_argument("--topk", type=int, default=d["topk"], help="experts per token")
    p.add_argument("--index-topk", type=int, default=d["index_topk"])
    p.add_argument("--indexer-pattern", default=d["indexer_pattern"],
                   help="one letter per layer, F=full / S=shared indexer (default: all F)")
    p.add_argument("--n-group", type=int, default=d["n_group"])
    p.add_argument("--topk-group", type=int, default=d["topk_group"])
    p.add_argument("--prompt-len", type=int, default=d["prompt_len"])
    p.add_argument("--new-tokens", type=int, default=d["new_tokens"])
    p.add_argument("--continue-tokens", type=int, default=d["continue_tokens"])
    p.add_argument("--vocab", type=int, default=d["vocab"])
    p.add_argument("--hidden", type=int, default=d["hidden"])
    p.add_argument("--force", action="store_true", help="replace DIR if it exists (only after a successful build)")
    p.add_argument("--no-safety-check", action="store_true",
                   help="write the oracle even if unsafe (oracle_safe: false); for diagnosis only")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    opts = {k: getattr(args, k) for k in DEFAULTS}
    try:
        _resolve_options(opts)
        if (os.path.lexists(args.out)) and not args.force:
            raise FileExistsError(f"{args.out} already exists (use --force to replace it)")
    except (ValueError, FileExistsError) as e:
        print(f"make_oracle: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        info = build_oracle(args.out, **opts, check_safety=not args.no_safety_check, force=args.force)
    except OracleUnsafe as e:
        print(f"make_oracle: {e.reason}", file=sys.stderr)
        return 1
    s = info["safety"]
    print(f"oracle written to {args.out} in {time.perf_counter() - t0:.1f} s "
          f"(oracle_safe={info['oracle_safe']})")
    print(f"  greedy_tokens: {info['greedy_tokens']}")
    print(f"  continuation:  {info['continuation']['greedy_tokens']}")
    print("  safety: " + ", ".join(f"{k}={s[k]:.3g}" if isinstance(s[k], float) else f"{k}={s[k]}"
                                    for k in ("min_indexer_rel_gap", "min_router_gap", "min_group_gap",
                                              "min_logit_margin", "cache_nocache_max_logit_diff",
                                              "reload_max_logit_diff", "sparse_rows")))
    if not info["oracle_safe"]:
        for f in s["failures"]:
            print("  UNSAFE " + _fmt_failure(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
