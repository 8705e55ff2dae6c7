"""coli bench stream: the pure parts (extrapolation, capacity scaling, summaries, delays, table cells), the
CachedHostTier / O_DIRECT reads on a tiny slice, and the CLI's no-GPU error. No GPU needed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coli.bench import stream as st
from coli.config import PRESETS
from coli.errors import ColiError
from coli.gpu.setup import WORKSPACE_BYTES, kv_bytes


def test_parse_scenarios():
    assert st.parse_scenarios("all") == ["peer", "warm", "cold-ram", "mapped", "disk", "budget", "spec", "sync"]
    assert st.parse_scenarios("mapped,cold-ram") == ["cold-ram", "mapped"]
    assert st.parse_scenarios("sync,spec") == ["spec", "sync"]
    assert st.parse_scenarios("sync, warm") == ["warm", "sync"]
    assert st.parse_scenarios("warm,peer") == ["peer", "warm"]
    with pytest.raises(ColiError, match="nope"):
        st.parse_scenarios("warm,nope")
    with pytest.raises(ColiError):
        st.parse_scenarios(" , ")


def test_split_and_extrapolate():
    # slice of 2 layers: token 10 ms, without routed experts 4 ms, head 0.5 ms
    moe, dense = st.split_times(0.010, 0.004, 2, 0.0005)
    assert moe == pytest.approx(0.003) and dense == pytest.approx(0.00175)
    tps = st.extrapolate(moe, dense, 0.002)
    assert tps == pytest.approx(1 / (75 * 0.003 + 78 * 0.00175 + 0.002))
    assert st.split_times(0.003, 0.004, 2, 0.005) == (0.0, 0.0)       # noise clamps to 0
    assert st.extrapolate(0, 0, 0) == math.inf
    with pytest.raises(ValueError):
        st.split_times(1, 1, 0, 0)


def test_device_split_takes_the_layers_from_the_graphs_device_time():
    # the replayed no-expert token: 0.62 ms of wall, 0.41 ms on the device of which the head 0.03 ms, 2 layers
    dense, fixed = st.device_split(0.00062, 0.00041, 2, 0.00003)
    assert dense == pytest.approx(0.00019) and fixed == pytest.approx(0.00021)
    moe = 0.00007                                   # the fixed time once per token, the layers 75 / 78 times
    tps = st.extrapolate(moe, dense, 0.002, fixed_s=fixed)
    assert tps == pytest.approx(1 / (0.00021 + 75 * moe + 78 * 0.00019 + 0.002))
    # the old split spreads the whole token over the 2 layers: 39 x the per-token time in a 78-layer model
    _, spread = st.split_times(0.00062, 0.00062, 2, 0.00003)
    assert spread == pytest.approx(0.000295) and st.extrapolate(moe, spread, 0.002) < tps
    assert st.device_split(0.0004, 0.00041, 2, 0.0005) == (0.0, 0.0)          # noise clamps to 0
    with pytest.raises(ValueError):
        st.device_split(1, 1, 0, 0)


def test_full_dense_bytes():
    # 2 layers of 0.43 GB + 0.05 GB of embed/head at vocab 4096
    b = st.full_dense_bytes(int(0.86e9 + 0.05e9), int(0.05e9), 2, 4096)
    assert b == int(0.43e9 * 78 + 0.05e9 * 154880 / 4096)


def test_scale_capacity_roomy_and_floor():
    slot = 20054016
    full = PRESETS["glm5"]
    kv = kv_bytes(full, 4096)
    d = st.scale_capacity(80, 64, 10_000_000_000, kv, WORKSPACE_BYTES, slot, 2, 8)
    n_full = (80_000_000_000 - 10_000_000_000 - kv - WORKSPACE_BYTES) // slot
    assert d["full_vram_slots"] == n_full
    assert d["per_layer_vram_slots"] == pytest.approx(n_full / 75, abs=1e-3)
    assert d["slice_vram_slots"] == int(n_full / 75 * 2)
    ram = 64_000_000_000 // slot
    assert d["full_ram_slots"] == ram and d["slice_ram_slots"] == int(ram / 75 * 2)
    assert d["notes"] == []
    # 16 GB with a 33 GB dense core: nothing fits, the slice gets the floor and says so
    d = st.scale_capacity(16, 64, 33_000_000_000, kv, WORKSPACE_BYTES, slot, 2, 8)
    assert d["full_vram_slots"] == 0 and d["slice_vram_slots"] == 16
    assert any("raised to 16" in n for n in d["notes"])


def test_summarise_and_delays():
    assert st.summarise([])["p50"] is None
    s = st.summarise([1, 2, 3, 4])
    assert s["n"] == 4 and s["p50"] == 2.5 and s["max"] == 4 and s["mean"] == 2.5
    # 50 GB/s peak: 1e6 bytes take 20 us nominal; tiles of 20 us
    d = st.demand_delays([25.0, 20.0, 60.0], [1_000_000] * 3, 50.0, 20.0)
    assert d["us"]["max"] == pytest.approx(40.0) and d["us"]["p50"] == pytest.approx(5.0)
    assert d["tiles"]["max"] == pytest.approx(2.0)
    assert st.demand_delays([1.0], [1], None, None)["us"] is None
    with pytest.raises(ValueError):
        st.demand_delays([1.0], [], 1.0, 1.0)


def test_overlap_and_delta():
    assert st.overlap_efficiency(0.004, 0.003, 0.002) == pytest.approx(4 / 3)
    assert st.overlap_efficiency(0.004, None, None) is None
    assert st.delta({"a": 5, "b": 1.5, "c": "x", "f": True}, {"a": 2, "b": 0.5}) == {"a": 3, "b": 1.0, "c": "x",
                                                                                   "f": True}


def test_row_figures_and_table():
    raw = {"scenario": "cold-ram", "token_s": [0.010, 0.012],
           "counters": {"copy_bytes": 2 * 16 * 20_000_000, "demand_copy_s": 0.016, "copies": 32, "hits": 0,
                        "misses": 32, "fallback_no_slot": 1, "cpu_fallbacks": 1, "vram_slots": 16},
           "delays_us": [500.0, 450.0], "delay_nbytes": [20_000_000, 20_000_000],
           "host": {}, "nvme_raw": {"bytes": 4e8, "read_s": 0.1, "direct_files": 1, "buffered_fallback": []}}
    ceil = {"whole_GBps": 50.0, "tiles": {1024: {"GBps": 45.0, "tile_us": 23.0}}}
    row = st._row_figures(raw, L=2, N=2, nomoe_s=0.004, head_slice=0.0005, head_full=0.002, dense_layer_s=0.00175,
                          warm_moe_layer_s=0.001, ceil=ceil, tile_kb=1024, nvme_peak=6.0)
    assert row["moe_layer_ms"] == pytest.approx(3.5)
    assert row["h2d"]["eff_busy_GBps"] == pytest.approx(40.0)
    assert row["h2d"]["busy_over_peak"] == pytest.approx(0.8)
    assert row["h2d"]["eff_wall_GBps"] == pytest.approx(0.64 / 0.022)
    assert row["overlap_efficiency"] == pytest.approx(3.5 / 4.0)      # copy 4 ms per layer > compute 1 ms
    assert row["hit_rates"]["vram"] == 0.0 and row["cpu_fallbacks"] == {"no_slot": 1}
    assert row["demand_delay"]["us"]["max"] == pytest.approx(100.0)
    assert row["demand_delay"]["tiles"]["max"] == pytest.approx(100 / 23)
    assert row["nvme"]["GBps_busy"] == pytest.approx(4.0) and row["nvme"]["busy_over_peak"] == pytest.approx(4 / 6)
    res = {"rows": [row, {"scenario": "peer", "run": False, "reason": "missing"},
                    {"scenario": "peer", "run": True, "result": {"tokens_per_s": 0.5}}]}
    cells = st.table_rows(res)
    assert cells[0][0] == "cold-ram" and cells[0][4].startswith("40.00 (80%)")
    assert "not run: missing" in cells[1][1] and cells[2][1] == "0.50"
    assert all(len(c) == len(st.HEADERS) for c in cells)


# ---- host tiers over a tiny slice (CPU) ---------------------------------------------------------------------
def test_cached_host_tier(tiny_slice3):
    from coli.container.reader import ContainerReader
    from coli.gpu.host_records import CachedHostTier
    r = ContainerReader(tiny_slice3)
    t = CachedHostTier(r, capacity=3, direct=True)
    got = list(t.grants(0, [1, 2]))
    recs = [g for g in got if g is not None]
    assert [g is None for g in got] == [True, False, True, False]          # each disk read announced
    for rec in recs:
        assert rec.addr % 4096 == 0
        assert np.array_equal(rec.array, r.read_record(0, rec.expert))
    assert t.stats["misses"] == 2 and t.probe(0, 1) is not None and t.probe(0, 3) is None
    old = t.probe(0, 1)
    for rec in recs:
        t.release(rec)
    got = list(t.grants(0, [2]))                                           # a RAM hit: no None
    assert len(got) == 1 and t.stats["hits"] == 1
    t.release(got[0])
    # two more misses: the LRU (expert 1) goes, its generation bumps
    for rec in [g for g in t.grants(1, [0, 1]) if g is not None]:
        t.release(rec)
    assert t.probe(0, 1) is None and not t.still_valid(old) and t.stats["evictions"] == 1
    # every slot leased: reclaim hook, then an error
    held = [g for g in t.grants(2, [0, 1, 2]) if g is not None]
    called = []
    t.reclaim_hook(lambda: called.append(1))
    with pytest.raises(RuntimeError, match="leased"):
        list(t.grants(2, [3]))
    assert called
    for g in held:
        t.release(g)
    with pytest.raises(ValueError):
        t.release(held[0])
    t.close()


def test_direct_reads_and_container_tier(tiny_slice):
    from coli.container.reader import ContainerReader
    from coli.gpu.host_records import ContainerHostTier
    r = ContainerReader(tiny_slice)
    h = ContainerHostTier(r, n_buffers=2, direct=True)
    recs = list(h.grants(0, [0, 5]))
    assert all(np.array_equal(x.array, r.read_record(0, x.expert)) for x in recs)
    d = h.direct
    assert d.bytes_read == sum(x.nbytes for x in recs)
    assert d.direct_files + len(d.fallback) == 1                       # O_DIRECT, or buffered where refused
    h.close()


def test_cli_stream_errors(tiny_slice, monkeypatch):
    from typer.testing import CliRunner
    from coli.cli.main import app
    from coli.gpu import cuda_runtime

    def nogpu(device=0):
        raise cuda_runtime.CudaUnavailable("no CUDA device (test)")
    monkeypatch.setattr(cuda_runtime, "get_runtime", nogpu)
    res = CliRunner().invoke(app, ["bench", "stream", str(tiny_slice), "--scenario", "warm"])
    assert res.exit_code == 2
    assert "coli bench stream needs a CUDA GPU" in res.output
    res = CliRunner().invoke(app, ["bench", "stream", str(tiny_slice), "--scenario", "bogus"])
    assert res.exit_code == 2 and "bogus" in res.output


def test_added_delay_is_measured_against_the_lanes_own_speed():
    # 20 MB copies at 1 us/MB reference; one copy took 52 us longer: 2 tiles of 26 us
    d = st.added_delay([20.0, 20.0, 72.0], [20e6, 20e6, 20e6], 1e-6, 26.0)
    assert d["us"]["max"] == pytest.approx(52.0)
    assert d["tiles"]["max"] == pytest.approx(2.0)
    assert d["us"]["p50"] == pytest.approx(0.0)


def test_mapped_link_is_the_layers_bytes_over_its_time_against_both_peaks():
    ceil = {"whole_GBps": 50.0, "mapped_read": {"GBps": 40.0}}
    got = st.mapped_link(4.0, 160_000_000, 32, ceil)          # 160 MB a layer in 4 ms: 40 GB/s
    assert got["eff_busy_GBps"] == pytest.approx(40.0)
    assert got["busy_over_peak"] == pytest.approx(0.8) and got["over_mapped_read"] == pytest.approx(1.0)
    assert got["copy_bytes"] == 160_000_000 * 32 and got["peak_whole_GBps"] == 50.0
    none = st.mapped_link(None, 160_000_000, 32, None)         # no MoE split, no ceilings: nulls, not a crash
    assert none["eff_busy_GBps"] is None and none["busy_over_peak"] is None and none["mapped_read_GBps"] is None


def test_the_mapped_row_prints_its_link_against_both_peaks_and_its_token_check(capsys):
    row = {"scenario": "mapped-ram", "token_ms": {"mean": 1.0}, "tokens_per_s_glm5": 4.1, "moe_layer_ms": 3.0,
           "tokens_equal_warm": True,
           "h2d": st.mapped_link(3.0, 160_000_000, 32, {"whole_GBps": 55.0, "mapped_read": {"GBps": 50.0}})}
    lines = []
    st.print_table({"slice": "s", "tokens": 4, "extrapolation": "e", "rows": [row]}, lines.append)
    said = [x for x in lines if x.startswith("mapped-ram:")]
    assert said == ["mapped-ram: the MoE kernels read 53.33 GB/s over PCIe, 97% of the copy engine's peak, 107% of "
                    "the mapped-read kernel's (50.00 GB/s); tokens equal warm's: True"]
    assert "53.33 (97%)" in st.table_rows({"rows": [row]})[0]
