"""The prefill chunk the GPU's memory allows (coli/gpu/prefill_budget.py) and its reserve in the VRAM plan
(coli/gpu/setup.py plan_slots): pure arithmetic on GLM-5's config, no GPU."""

import pytest

from coli.config import ModelConfig
from coli.errors import ColiError
from coli.gpu import cuda_backend
from coli.gpu.prefill_budget import (ATTN_PREFILL_ROWS, AUTO_SHARE, PREFILL_CHUNK_BYTES, attention_block_bytes,
                                     auto_prefill_chunk, moe_token_bytes, prefill_workspace_bytes, row_bytes)
from coli.gpu.setup import WORKSPACE_BYTES, plan_slots

GLM5 = ModelConfig()
GB = 10**9


def test_the_moe_buffers_follow_the_backends_chunk_bound():
    assert PREFILL_CHUNK_BYTES == cuda_backend.PREFILL_CHUNK_BYTES
    # below the bound the MoE buffers grow with the rows; past it they stay one chunk
    small = prefill_workspace_bytes(GLM5, 128)
    assert small == 128 * (row_bytes(GLM5) + moe_token_bytes(GLM5)) + attention_block_bytes(GLM5, 128)
    big = prefill_workspace_bytes(GLM5, 8192)
    chunk = PREFILL_CHUNK_BYTES // moe_token_bytes(GLM5)           # rows of one chunk: 3,536 at GLM-5's shapes
    split_x = GLM5.hidden_size * 19 // 4                            # x's split of a row, kept for later batches
    assert chunk == 3536
    assert big == (8192 * row_bytes(GLM5) + attention_block_bytes(GLM5, 8192) + chunk * moe_token_bytes(GLM5)
                   + (8192 - chunk) * split_x)
    assert big <= 8192 * row_bytes(GLM5) + attention_block_bytes(GLM5, 8192) + PREFILL_CHUNK_BYTES + 8192 * split_x


def test_the_attentions_queries_and_contexts_take_one_block_of_rows_whatever_the_chunk():
    assert ATTN_PREFILL_ROWS == cuda_backend.ATTN_PREFILL_ROWS
    per_row = 2 * GLM5.num_attention_heads * GLM5.kv_lora_rank * 4          # q_abs + ctx, [nh, Lkv] f32 each
    assert per_row == 262144
    assert attention_block_bytes(GLM5, 100) == 100 * per_row
    assert attention_block_bytes(GLM5, 8192) == attention_block_bytes(GLM5, ATTN_PREFILL_ROWS) == 512 * per_row


# (the attention's [rows, nh, Lkv] buffers in blocks doubled the 16, 24 and 48 GB chunks: 1,024 / 2,048 / 4,096 before)
@pytest.mark.parametrize("budget_gb,chunk", [(16, 2048), (24, 4096), (32, 4096), (48, 8192), (80, 8192), (141, 8192)])
def test_auto_takes_the_largest_power_of_two_within_an_eighth_of_the_budget(budget_gb, chunk):
    got = auto_prefill_chunk(GLM5, budget_gb * GB, max_context=202752, step_tokens=128)
    assert got == chunk
    assert prefill_workspace_bytes(GLM5, got) * AUTO_SHARE <= budget_gb * GB
    if got < 8192:      # the next power of two would not fit
        assert prefill_workspace_bytes(GLM5, 2 * got) * AUTO_SHARE > budget_gb * GB


def test_auto_is_bounded_by_max_context_and_never_below_the_step_budget():
    assert auto_prefill_chunk(GLM5, 141 * GB, max_context=3000, step_tokens=128) == 2048
    assert auto_prefill_chunk(GLM5, 1 * GB, max_context=4096, step_tokens=128) == 128


def test_the_vram_plan_reserves_the_chunk_before_the_expert_slots():
    kw = dict(vram_gb=40.0, max_context=4096)
    plain = plan_slots(GLM5, 20 << 20, 10 * GB, **kw)
    chunk = plan_slots(GLM5, 20 << 20, 10 * GB, **kw, prefill_rows=4096)
    assert chunk["workspace_bytes"] == WORKSPACE_BYTES + prefill_workspace_bytes(GLM5, 4096)
    assert chunk["slots"] < plain["slots"]


def test_a_chunk_the_budget_cannot_hold_names_both_settings():
    with pytest.raises(ColiError, match=r"raise --vram-gb.*8192-token prefill chunk.*lower --prefill-chunk"):
        plan_slots(GLM5, 20 << 20, 10 * GB, vram_gb=15.0, max_context=4096, prefill_rows=8192)


def test_no_chunk_is_reserved_when_every_expert_fits_without_it():
    from coli.config import PRESETS
    tiny = PRESETS["tiny"]
    n = len(tiny.moe_layers) * tiny.n_routed_experts
    kw = dict(vram_gb=2.0, max_context=4096)
    bare = plan_slots(tiny, 1 << 20, 10 << 20, **kw)
    assert bare["slots"] >= n                          # 2 GB holds every 1 MB expert of the tiny model
    assert plan_slots(tiny, 1 << 20, 10 << 20, **kw, prefill_rows=8192) == bare
