"""Sizing and building the VRAM expert cache for a model already resident on the CUDA backend.

The budget (`--vram-gb`) pays, in order: the dense core (measured: what the backend's memory pool holds
once the model is built), the KV cache at `--max-context` positions (computed from the config), and
workspaces (activations, per-step tables, the grouped-MoE and indexer chunks) plus the rows of the largest step
(`prefill_rows`: the prefill chunk, coli/gpu/prefill_budget.py); what is left becomes expert slots. `--vram-slots N` sets the slot count directly (tests, benchmarks)."""

from __future__ import annotations

from coli.config import ModelConfig
from coli.errors import ColiError
from coli.container.format import align
from coli.gpu.lanes import DEFAULT_TILE_BYTES
from coli.gpu.pool import describe_pool, size_pool
from coli.gpu.prefill_budget import prefill_workspace_bytes

GB = 1e9
WORKSPACE_BYTES = 768 << 20     # MOE_CHUNK_BYTES + INDEXER_CHUNK_BYTES + activations and slack


def kv_bytes(cfg: ModelConfig, positions: int) -> int:
    """Bytes of the compressed KV cache (f32) at `positions` tokens (coli.model.kv_cache)."""
    per = 0
    for i in range(cfg.num_hidden_layers):
        per += cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.indexer_types[i] == "full":
            per += cfg.index_head_dim
    return 4 * per * positions


def plan_slots(cfg: ModelConfig, record_bytes: int, dense_bytes: int, *, vram_gb: float | None,
               max_context: int, slots: int | None = None, prefill_rows: int = 0) -> dict:
    """size_pool's plan at this budget; `prefill_rows` (the prefill chunk) reserved in the workspaces unless the
    budget holds every routed expert without it (then nothing streams and the chunk is never used)."""
    slot_bytes = align(record_bytes, 4096)
    if slots is not None:
        return {"slots": int(slots), "slot_bytes": slot_bytes, "pool_bytes": int(slots) * slot_bytes,
                "dense_bytes": dense_bytes, "kv_bytes": kv_bytes(cfg, max_context), "workspace_bytes": 0,
                "budget_bytes": None}
    if prefill_rows:
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


def build_vram_experts(model, host, cfg: ModelConfig, layout, *, vram_gb: float | None, slots: int | None = None,
                       max_context: int = 4096, policy: str = "freq", tile_bytes: int = DEFAULT_TILE_BYTES,
                       faults=None, log=None, prefill_rows: int = 0):
    """Put a VramExperts source on `model` (CUDA backend, dense core already resident). -> (source, plan)."""
    from coli.gpu.vram_experts import VramExperts
    b = model.backend
    dense = int(b.rt.pool.active_bytes)
    plan = plan_slots(cfg, layout.nbytes, dense, vram_gb=vram_gb, max_context=max_context, slots=slots,
                      prefill_rows=prefill_rows)
    vx = VramExperts(b, host, layout, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok,
                     plan["slots"], policy=policy, tile_bytes=tile_bytes, faults=faults, log=log)
    model.experts = vx
    plan["line"] = describe_pool(plan) if plan.get("budget_bytes") else (
        f"VRAM pool: {plan['slots']} slots x {plan['slot_bytes'] / 1e6:.2f} MB (set by --vram-slots), "
        f"dense {dense / 1e9:.3f} GB resident")
    return vx, plan
