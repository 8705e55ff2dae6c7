"""Where the MTP layer's routed experts live under a VRAM budget (coli.gpu.setup.plan_mtp): paid from the budget,
resident while they take at most MTP_RESIDENT_SHARE of the expert pool, else uploaded on use into room reserved
for one draft's top-k records; never outside --vram-gb (they were, before: 4.9 GB for GLM-5's int4 layer)."""

from __future__ import annotations

import pytest

from coli.config import PRESETS
from coli.gpu.setup import MTP_RESIDENT_SHARE, WORKSPACE_BYTES, describe_mtp, kv_bytes, plan_mtp, plan_slots

GB = 1e9
GLM5 = PRESETS["glm5"]
RECORD = 19_000_000           # about a GLM-5 int4 expert record
SLOT = -(-RECORD // 4096) * 4096


def _plan(vram_gb: float, dense: int, record: int = RECORD, cfg=GLM5, ctx: int = 4096) -> dict:
    return plan_mtp(cfg, plan_slots(cfg, record, dense, vram_gb=vram_gb, max_context=ctx))


def _total(p: dict) -> int:
    return p["dense_bytes"] + p["kv_bytes"] + p["workspace_bytes"] + p["pool_bytes"] + p["mtp_bytes"]


def test_a_big_card_keeps_the_mtp_layer_resident_inside_the_budget():
    before = plan_slots(GLM5, RECORD, 10 * 10**9, vram_gb=120, max_context=4096)
    p = _plan(120, 10 * 10**9)
    layer = GLM5.n_routed_experts * SLOT
    assert layer <= MTP_RESIDENT_SHARE * before["pool_bytes"]
    assert (p["mtp"], p["mtp_bytes"]) == ("resident", layer)
    assert p["slots"] == before["slots"] - -(-layer // SLOT)      # the slots pay for it
    assert _total(p) <= 120 * GB
    assert "MTP layer's experts resident" in describe_mtp(p)


def test_a_consumer_card_uploads_the_mtp_experts_on_use_and_reserves_one_drafts_worth():
    before = plan_slots(GLM5, RECORD, 9 * 10**9, vram_gb=16, max_context=4096)
    p = _plan(16, 9 * 10**9)
    assert GLM5.n_routed_experts * SLOT > MTP_RESIDENT_SHARE * before["pool_bytes"]
    assert (p["mtp"], p["mtp_bytes"]) == ("upload", GLM5.num_experts_per_tok * SLOT)
    assert p["slots"] == before["slots"] - GLM5.num_experts_per_tok
    assert p["workspace_bytes"] == WORKSPACE_BYTES and _total(p) <= 16 * GB
    assert "uploaded on use" in describe_mtp(p)


def test_a_budget_with_room_for_neither_says_so_and_keeps_the_main_plan():
    slot_room = 3 * SLOT                                  # 3 slots: top-8 uploads would leave fewer than 2
    dense = int(16 * GB) - kv_bytes(GLM5, 4096) - WORKSPACE_BYTES - slot_room
    before = plan_slots(GLM5, RECORD, dense, vram_gb=16, max_context=4096)
    p = _plan(16, dense)
    assert before["slots"] == 3
    assert p["mtp"] == "none" and p["slots"] == 3 and p["mtp_bytes"] == 0
    assert "raise --vram-gb" in p["mtp_problem"] and "no room" in describe_mtp(p)


def test_vram_slots_without_a_budget_keep_the_layer_resident_beside_them():
    p = plan_mtp(GLM5, plan_slots(GLM5, RECORD, 0, vram_gb=None, max_context=4096, slots=6))
    assert (p["mtp"], p["slots"]) == ("resident", 6)


@pytest.mark.parametrize("vram_gb", [12, 16, 24, 32, 48, 80, 141])
def test_the_mtp_plan_never_exceeds_the_budget(vram_gb):
    p = _plan(vram_gb, 9 * 10**9)
    assert p["mtp"] in ("resident", "upload")
    assert _total(p) <= vram_gb * GB and p["slots"] >= 2


def test_coli_mtp_experts_forces_the_choice_and_a_bad_value_is_named():
    from coli.errors import ColiError
    from coli.gpu.setup import mtp_experts_choice
    assert mtp_experts_choice({}) == "auto"
    assert plan_mtp(GLM5, plan_slots(GLM5, RECORD, 0, vram_gb=None, max_context=4096, slots=6),
                    mtp_experts_choice({"COLI_MTP_EXPERTS": "upload"}))["mtp"] == "upload"
    assert _plan(120, 10 * 10**9)["mtp"] == "resident"
    assert plan_mtp(GLM5, plan_slots(GLM5, RECORD, 10 * 10**9, vram_gb=120, max_context=4096), "upload")["mtp"] == \
        "upload"
    with pytest.raises(ColiError, match="COLI_MTP_EXPERTS='sometimes'"):
        mtp_experts_choice({"COLI_MTP_EXPERTS": "sometimes"})


def test_an_mtp_layer_that_makes_the_experts_stream_gets_the_prefill_chunk_reserved():
    """plan_slots leaves the chunk out when every main expert fits; the MTP layer's resident experts then take 256
    slots, the main experts stream and steps take the chunk's rows: plan_vram reserves them (it went ~3.9 GB over)."""
    from coli.gpu.prefill_budget import prefill_workspace_bytes
    from coli.gpu.setup import plan_vram
    record, chunk = 1_000_000, 4096
    slot = -(-record // 4096) * 4096
    every = len(GLM5.moe_layers) * GLM5.n_routed_experts
    dense = 10 * 10**9
    budget = dense + kv_bytes(GLM5, 4096) + WORKSPACE_BYTES + (every + 100) * slot     # 100 slots to spare
    kw = dict(vram_gb=budget / GB, max_context=4096, prefill_rows=chunk)
    assert plan_slots(GLM5, record, dense, **kw)["slots"] >= every      # no chunk reserved: nothing would stream
    p = plan_vram(GLM5, record, dense, **kw, mtp="auto")
    assert p["mtp"] in ("resident", "upload") and p["slots"] < every     # ... but with the MTP layer it streams
    assert p["workspace_bytes"] == WORKSPACE_BYTES + prefill_workspace_bytes(GLM5, chunk)
    assert _total(p) <= p["budget_bytes"]
    # the same budget without an MTP layer, or where every expert still fits beside it, reserves nothing
    assert plan_vram(GLM5, record, dense, **kw) == plan_slots(GLM5, record, dense, **kw)
    roomy = dict(kw, vram_gb=(budget + 300 * slot) / GB)
    q = plan_vram(GLM5, record, dense, **roomy, mtp="auto")
    assert q["slots"] >= every and q["workspace_bytes"] == WORKSPACE_BYTES


def test_a_forced_resident_that_does_not_fit_is_refused_not_turned_into_uploads():
    small = plan_slots(GLM5, RECORD, 11 * 10**9, vram_gb=16, max_context=4096)     # ~3 GB of slots
    assert GLM5.n_routed_experts * SLOT > small["pool_bytes"]
    p = plan_mtp(GLM5, small, "resident")
    assert p["mtp"] == "none" and "COLI_MTP_EXPERTS=resident" in p["mtp_problem"]
    assert plan_mtp(GLM5, small, "auto")["mtp"] == "upload"                        # auto does fall back
    up = plan_mtp(GLM5, plan_slots(GLM5, RECORD, 9 * 10**9, vram_gb=16, max_context=4096), "upload")
    assert up["mtp"] == "upload" and "forced by COLI_MTP_EXPERTS" in describe_mtp(up)
    auto = _plan(16, 9 * 10**9)
    assert auto["mtp"] == "upload" and "would take over 25% of the pool" in describe_mtp(auto)
