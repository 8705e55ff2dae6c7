"""Sizing and building the VRAM expert cache for a model already resident on the CUDA backend.

The budget (`--vram-gb`) pays, in order: the dense core (measured: what the backend's memory pool holds
once the model is built), the KV cache at `--max-context` positions (computed from the config), and
workspaces (activations, per-step tables, the grouped-MoE and indexer chunks) plus the rows of the largest step
(`prefill_rows`: the prefill chunk, coli/gpu/prefill_budget.py); what is left becomes expert slots. `--vram-slots N`
sets the slot count directly (tests, benchmarks).

A container with an MTP layer (issue 16) has one more MoE layer's experts, which the draft head reads. They are
paid from the same budget (`plan_mtp`): kept resident when they take at most MTP_RESIDENT_SHARE of what the budget
leaves for experts (a big card: the slots lose little), else uploaded from the container when a draft uses them
(a consumer card: a resident MTP layer would take most of its slots; room for one step's top-k uploads is
reserved instead). Before this, the MTP layer's experts were allocated outside the budget on the first MTP request:
4.9 GB more than `--vram-gb` for GLM-5's int4 layer."""

from __future__ import annotations

import os

from coli.config import ModelConfig
from coli.errors import ColiError
from coli.container.format import align
from coli.gpu.lanes import DEFAULT_TILE_BYTES
from coli.gpu.layer_ahead import ahead_layers_for, describe_ahead
from coli.gpu.pool import describe_pool, size_pool
from coli.gpu.prefill_budget import prefill_workspace_bytes

GB = 1e9
WORKSPACE_BYTES = 768 << 20     # MOE_CHUNK_BYTES + INDEXER_CHUNK_BYTES + activations and slack
MTP_RESIDENT_SHARE = 0.25       # the MTP layer's experts stay resident while they take at most this share of the pool


def kv_bytes(cfg: ModelConfig, positions: int) -> int:
    """Bytes of the compressed KV cache (f32) at `positions` tokens (coli.model.kv_cache)."""
    per = 0
    for i in range(cfg.num_hidden_layers):
        per += cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.indexer_types[i] == "full":
            per += cfg.index_head_dim
    return 4 * per * positions


def plan_slots(cfg: ModelConfig, record_bytes: int, dense_bytes: int, *, vram_gb: float | None,
               max_context: int, slots: int | None = None, prefill_rows: int = 0, always_reserve: bool = False) -> dict:
    """size_pool's plan at this budget; `prefill_rows` (the prefill chunk) reserved in the workspaces unless the
    budget holds every routed expert without it (then nothing streams and the chunk is never used) and not
    `always_reserve` (plan_vram: the MTP layer's experts took slots, so the main layers' experts stream after all)."""
    slot_bytes = align(record_bytes, 4096)
    if slots is not None:
        return {"slots": int(slots), "slot_bytes": slot_bytes, "pool_bytes": int(slots) * slot_bytes,
                "dense_bytes": dense_bytes, "kv_bytes": kv_bytes(cfg, max_context), "workspace_bytes": 0,
                "budget_bytes": None}
    if prefill_rows and not always_reserve:
        bare = plan_slots(cfg, record_bytes, dense_bytes, vram_gb=vram_gb, max_context=max_context)
        if bare["slots"] >= len(cfg.moe_layers) * cfg.n_routed_experts:
            return bare     # every expert resident even so: steps keep --step-tokens, no chunk to reserve for
    workspace = WORKSPACE_BYTES + prefill_workspace_bytes(cfg, prefill_rows)
    try:
        return size_pool(int(vram_gb * GB), dense_bytes, kv_bytes(cfg, max_context), workspace, slot_bytes,
                         min_slots=2)
    except ColiError as e:
        if not prefill_rows:
            raise
        raise ColiError(f"{e}; the workspaces hold a {prefill_rows}-token prefill chunk "
                        f"({prefill_workspace_bytes(cfg, prefill_rows) / GB:.2f} GB): or lower --prefill-chunk") from None


def plan_vram(cfg: ModelConfig, record_bytes: int, dense_bytes: int, *, vram_gb: float | None, max_context: int,
              slots: int | None = None, prefill_rows: int = 0, mtp: str | None = None) -> dict:
    """The whole budget's plan: plan_slots for the main layers, then (`mtp`: the container has an MTP layer, this is
    COLI_MTP_EXPERTS' choice) plan_mtp. plan_slots leaves the prefill chunk out when every main expert fits; if the
    MTP layer's experts then push the slots below every main expert, the experts stream and steps do take the chunk's
    rows, so the plan is made again with them reserved (without that: GLM-5's shape with room for 100 slots beyond
    every expert went ~3.9 GB over --vram-gb on a 4,096-token chunk)."""
    kw = dict(vram_gb=vram_gb, max_context=max_context, slots=slots, prefill_rows=prefill_rows)
    plan = plan_slots(cfg, record_bytes, dense_bytes, **kw)
    if mtp is None:
        return plan
    out = plan_mtp(cfg, plan, mtp)
    every = len(cfg.moe_layers) * cfg.n_routed_experts
    if prefill_rows and plan.get("budget_bytes") is not None and out["slots"] < every <= plan["slots"]:
        out = plan_mtp(cfg, plan_slots(cfg, record_bytes, dense_bytes, **kw, always_reserve=True), mtp)
    return out


MTP_EXPERTS_CHOICES = ("auto", "resident", "upload")


def mtp_experts_choice(env: dict | None = None) -> str:
    """COLI_MTP_EXPERTS: "auto" (the default: plan_mtp's share rule), "resident" or "upload" (forced: tests, drills)."""
    v = (os.environ if env is None else env).get("COLI_MTP_EXPERTS", "auto").strip().lower() or "auto"
    if v not in MTP_EXPERTS_CHOICES:
        raise ColiError(f"COLI_MTP_EXPERTS={v!r}: use one of {', '.join(MTP_EXPERTS_CHOICES)}")
    return v


def plan_mtp(cfg: ModelConfig, plan: dict, choice: str = "auto") -> dict:
    """Where the MTP layer's routed experts live under `plan` (plan_slots' result for the main layers) -> the plan,
    re-sized, with "mtp" ("resident": all E records on the device, paid from the budget; "upload": each draft
    uploads the records it reads into room reserved for top-k of them; "none": the budget has room for neither)
    and "mtp_bytes" (what that takes). With --vram-slots (no budget) the layer is resident beside the slots unless
    `choice` forces "upload"."""
    slot_bytes = plan["slot_bytes"]
    layer_bytes = cfg.n_routed_experts * slot_bytes
    up = cfg.num_experts_per_tok * slot_bytes
    if plan.get("budget_bytes") is None:
        return {**plan, "mtp": "upload", "mtp_bytes": up} if choice == "upload" else \
            {**plan, "mtp": "resident", "mtp_bytes": layer_bytes}
    ws, kv, dense = plan["workspace_bytes"], plan["kv_bytes"], plan["dense_bytes"]
    forced = "forced by COLI_MTP_EXPERTS"
    share = f"they would take over {MTP_RESIDENT_SHARE:.0%} of the pool"
    if choice == "upload":
        choices = (("upload", up, forced),)
    elif choice == "resident":                       # forced: no quiet fall-back to uploads
        choices = (("resident", layer_bytes, forced),)
    elif layer_bytes <= MTP_RESIDENT_SHARE * plan["pool_bytes"]:
        choices = (("resident", layer_bytes, f"at most {MTP_RESIDENT_SHARE:.0%} of the pool"),
                   ("upload", up, "no room for them resident beside 2 slots"))
    else:
        choices = (("upload", up, share),)
    for mode, extra, why in choices:
        try:
            p = size_pool(plan["budget_bytes"], dense, kv, ws + extra, slot_bytes, min_slots=2)
        except ColiError:
            continue
        return {**p, "workspace_bytes": ws, "mtp": mode, "mtp_bytes": extra, "mtp_reason": why}
    what = (f"the MTP layer's experts resident ({layer_bytes / 1e9:.2f} GB, COLI_MTP_EXPERTS=resident)"
            if choice == "resident" else "the MTP layer's experts")
    return {**plan, "mtp": "none", "mtp_bytes": 0,
            "mtp_problem": f"the VRAM budget leaves no room for {what} beside {plan['slots']} slots (raise --vram-gb)"}


def describe_mtp(plan: dict) -> str:
    """The start-up log's words for plan_mtp's choice."""
    mode, n = plan.get("mtp"), plan.get("mtp_bytes", 0) / 1e9
    why = plan.get("mtp_reason")
    if mode == "resident":
        return f"; MTP layer's experts resident ({n:.2f} GB{': ' + why if why else ''})"
    if mode == "upload":
        return f"; MTP layer's experts uploaded on use ({n:.2f} GB reserved{': ' + why if why else ''})"
    return f"; no room for the MTP layer's experts ({plan.get('mtp_problem')})" if mode == "none" else ""


def build_vram_experts(model, host, cfg: ModelConfig, layout, *, vram_gb: float | None, slots: int | None = None,
                       max_context: int = 4096, policy: str = "freq", tile_bytes: int = DEFAULT_TILE_BYTES,
                       faults=None, log=None, prefill_rows: int = 0):
    """Put a VramExperts source on `model` (CUDA backend, dense core already resident). -> (source, plan). Long
    prefills copy the next MoE layer's experts ahead where the pool has room and COLI_PREFILL_AHEAD allows
    (coli/gpu/layer_ahead.py; plan["prefill_ahead"])."""
    from coli.gpu.vram_experts import VramExperts
    b = model.backend
    dense = int(b.rt.pool.active_bytes)
    has_mtp = getattr(model.weights, "mtp_layer", None) is not None    # the draft head's experts: same budget
    choice = mtp_experts_choice()          # read (and a bad value refused) whether or not the container has the layer
    plan = plan_vram(cfg, layout.nbytes, dense, vram_gb=vram_gb, max_context=max_context, slots=slots,
                     prefill_rows=prefill_rows, mtp=choice if has_mtp else None)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    ahead = ahead_layers_for(cfg.moe_layers, E, K, plan["slots"])     # COLI_PREFILL_AHEAD and room for it
    vx = VramExperts(b, host, layout, cfg.num_hidden_layers, E, K, plan["slots"], policy=policy,
                     tile_bytes=tile_bytes, faults=faults, log=log, ahead_layers=ahead)
    plan["prefill_ahead"] = ahead is not None
    model.experts = vx
    plan["line"] = describe_pool(plan) if plan.get("budget_bytes") else (
        f"VRAM pool: {plan['slots']} slots x {plan['slot_bytes'] / 1e6:.2f} MB (set by --vram-slots), "
        f"dense {dense / 1e9:.3f} GB resident")
    plan["line"] += describe_mtp(plan)
    plan["line"] += describe_ahead(ahead, plan["slots"], E, K)
    vx.mtp_mode = plan.get("mtp", "resident")          # read by coli.model.mtp.load_mtp_head
    vx.mtp_problem = plan.get("mtp_problem")
    return vx, plan
