"""The `coli stats` view as a pure function: the CPU path shows what it does (compute, waiting for
experts) instead of PCIe/SM rows at 0 %; requests are split into queued, running, done, cancelled, failed."""

from coli.stats_view import rows


def table(snap, prev=None, device=None):
    return {(a or "", b): c for a, b, c in rows(snap, prev, device)}


def cpu_snaps():
    prev = {"executor": {"t": 10.0, "prefill_s": 0.0, "decode_s": 1.0, "wait_s": 0.2, "experts_served": 10}}
    now = {"executor": {"t": 12.0, "prefill_s": 0.5, "decode_s": 2.5, "wait_s": 0.6, "experts_served": 90,
                        "copy_busy": 0.0, "sm_busy": 0.0, "tokens": 5}}
    return now, prev


def test_cpu_path_shows_compute_and_expert_waits_not_pcie():
    now, prev = cpu_snaps()
    t = table(now, prev, device="numpy")
    assert not any("PCIe" in k[0] or k[0] == "SMs" for k in t)
    # 2 s of wall time: (0.5 + 1.5) s forward of which 0.4 s waiting for experts
    assert t[("CPU compute (numpy)", "busy")].strip() == "80.0 %"
    assert t[("", "waiting for experts")].strip() == "20.0 %"
    assert t[("", "experts computed")] == "90"
    assert table(now, prev) == t  # without the device, the counters tell the CPU path too


def test_gpu_path_keeps_the_pcie_and_sm_rows():
    now = {"executor": {"t": 1.0, "copy_busy": 0.5, "sm_busy": 0.25, "cpu_fallbacks": 3}}
    t = table(now, device="cuda")
    assert t[("PCIe copy lanes", "busy")].strip() == "50.0 %" and t[("SMs", "busy")].strip() == "25.0 %"
    assert t[("CPU fallbacks", "experts")] == "3"


def test_requests_running_and_cancelled_are_their_own_counts():
    snap = {"supervisor": {"queued": 2, "running": 1, "completed": 4, "cancelled": 3, "failed": 1}}
    t = table(snap)
    assert t[("requests", "queued / running")] == "2 / 1"
    assert t[("", "done / cancelled / failed")] == "4 / 3 / 1"


def test_mtp_rows_show_tokens_per_step_and_acceptance_per_position():
    now, prev = cpu_snaps()
    assert not any(k[0] == "MTP drafts" for k in table(now, prev))        # no MTP: no rows
    now["executor"].update(mtp_rounds=10, mtp_tokens=18, mtp_drafted_1=10, mtp_accepted_1=6, mtp_drafted_2=10,
                           mtp_accepted_2=2)
    t = table(now, prev)
    assert t[("MTP drafts", "tokens per step")].strip() == "1.80"
    assert t[("", "acceptance per position")] == "60.0 % / 20.0 %"


def test_the_batch_shows_running_and_waiting_sequences_tokens_per_step_and_the_prefill_share():
    prev = {"executor": {"t": 10.0, "steps": 100, "rows": 300, "prefill_tokens_fed": 500, "decode_tokens_fed": 300}}
    now = {"executor": {"t": 12.0, "steps": 150, "rows": 550, "prefill_tokens_fed": 600, "decode_tokens_fed": 700,
                        "batch_running": 5, "batch_waiting": 1, "max_batch": 8},
           "supervisor": {"queued": 3, "running": 6}}
    t = table(now, prev, device="numpy")
    assert t[("batch", "running / waiting")] == "5 / 4 (max 8)"     # waiting: 1 at the executor + 3 held back
    assert t[("", "tokens per step")] == "10.0"                      # (100 + 400) tokens over 50 steps
    assert t[("", "sequences per step")] == "5.0"
    assert t[("", "prefill / decode tokens")] == "20 % / 80 %"
    since_start = table(now, device="numpy")                        # no previous snapshot: the averages so far
    assert since_start[("", "tokens per step")] == "8.7" and since_start[("", "prefill / decode tokens")] == "46 % / 54 %"
    assert ("", "step budget") not in t                               # an executor from before the setting


def test_the_batch_says_which_step_budget_applies():
    e = {"t": 1.0, "steps": 1, "step_tokens": 128, "prefill_chunk": 8192, "experts_stream": 1}
    assert table({"executor": e}, device="cuda")[("", "step budget")] == "8192 tokens (experts stream: --prefill-chunk)"
    e["experts_stream"] = 0
    assert table({"executor": e}, device="cuda")[("", "step budget")] == "128 tokens (--step-tokens)"


def test_cpu_busy_counts_a_batched_step_once_not_once_per_request():
    prev = {"executor": {"t": 10.0, "step_s": 1.0, "prefill_s": 0.0, "decode_s": 1.0, "wait_s": 0.0}}
    # 4 requests decoding in the same steps for 1 s: their decode times add up to 4 s, the engine was busy 1 s of 2
    now = {"executor": {"t": 12.0, "step_s": 2.0, "prefill_s": 0.0, "decode_s": 5.0, "wait_s": 0.0}}
    assert table(now, prev, device="numpy")[("CPU compute (numpy)", "busy")].strip() == "50.0 %"


def test_the_vram_cache_shows_the_layers_a_long_prefill_copied_ahead():
    now = {"executor": {"t": 1.0, "vram_slots": 520, "vram_resident": 300, "copy_busy": 0.5,
                        "ahead_layers": 74, "ahead_copies": 18944, "ahead_bytes": 3_500_000_000}}
    t = table(now, device="cuda")
    assert t[("", "layers copied ahead")] == "74 (3.500 GB)"          # stats from before ahead_first: as they were
    now["executor"]["ahead_first"] = 1                   # the forward's first MoE layer, copied from the step's start
    assert table(now, device="cuda")[("", "layers copied ahead")] == "74 (3.500 GB; 1 from a step's start)"
    del now["executor"]["ahead_layers"]                 # an engine without the counters (older stats): no row
    assert ("", "layers copied ahead") not in table(now, device="cuda")
