"""The executor's published stats: the batch scheduler's counters are not overwritten by the VRAM engine's.

Both count "steps" (the scheduler: batched model steps; the VRAM engine: its per-MoE-layer stream calls). On the
H200 the engine's count won and `coli stats` showed fewer rows than steps for a batch that shared every step
(tests/gpu/test_gpu_batchserve.py: rows 106, steps 165)."""

from coli.stages.executor.process import merged_stats


def test_the_schedulers_steps_win_over_the_vram_engines():
    counters = {"requests": 3, "tokens": 40, "failed": 0}
    ram_tier = {"expert_requests": 12}
    vram = {"steps": 165, "copies": 30, "vram_slots": 6}           # VramExperts.snapshot(): 165 MoE-layer streams
    batch = {"steps": 40, "rows": 106, "batch_running": 0, "batch_waiting": 0}  # Scheduler.snapshot()
    c = merged_stats(counters, ram_tier, vram, batch, uptime_s=1.5)
    assert c["steps"] == 40 and c["rows"] == 106 and c["rows"] > c["steps"]
    assert c["copies"] == 30 and c["vram_slots"] == 6 and c["expert_requests"] == 12
    assert c["requests"] == 3 and c["uptime_s"] == 1.5
    assert counters == {"requests": 3, "tokens": 40, "failed": 0}   # the live counters are not modified
