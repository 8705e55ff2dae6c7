"""coli.bench.ceilings: the O_DIRECT read peak on a small file (O_DIRECT or the stated buffered fallback, whichever
this filesystem allows), its errors naming the file; the pinned H2D peak only with a GPU."""

from __future__ import annotations

import os

import pytest

from coli.bench.ceilings import CeilingError, h2d_peak, mapped_read_peak, odirect_read_peak


@pytest.fixture()
def data_file(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(3 << 20) + b"x" * 100)      # 3 MiB + a ragged tail
    return p


def test_odirect_result_shape(data_file):
    r = odirect_read_peak(data_file, block_mb=(1, 2, 8), threads=(1, 2), seconds=0.05)
    assert set(r) == {"path", "size", "o_direct", "page_cache", "note", "best_GBps", "best", "table", "skipped",
                      "seconds_each"}
    assert r["path"] == str(data_file) and r["size"] == (3 << 20) + 100
    assert [(t["block_mb"], t["threads"]) for t in r["table"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert r["skipped"] == [{"block_mb": 8, "why": "larger than the file"}]
    for t in r["table"]:
        assert set(t) == {"block_mb", "threads", "GBps", "bytes", "seconds"}
        assert t["bytes"] > 0 and t["bytes"] % (t["block_mb"] << 20) == 0 and t["GBps"] > 0
    assert r["best_GBps"] == max(t["GBps"] for t in r["table"])
    assert set(r["best"]) == {"block_mb", "threads"}
    if r["o_direct"]:
        assert "bypass" in r["note"] and "bypassed" in r["page_cache"]
    else:
        assert "BUFFERED fallback" in r["note"] and "page cache" in r["note"]


def test_odirect_errors_name_the_file(tmp_path, data_file):
    missing = tmp_path / "nope.bin"
    with pytest.raises(CeilingError, match="nope.bin"):
        odirect_read_peak(missing, seconds=0.01)
    with pytest.raises(CeilingError, match="blob.bin.*smaller than the smallest block"):
        odirect_read_peak(data_file, block_mb=(4,), threads=(1,), seconds=0.01)
    with pytest.raises(CeilingError, match="blob.bin"):
        odirect_read_peak(data_file, block_mb=(1,), threads=(0,), seconds=0.01)


def test_h2d_peak_rejects_bad_sizes_before_touching_cuda():
    with pytest.raises(CeilingError, match="nbytes"):
        h2d_peak(nbytes=1000)
    with pytest.raises(CeilingError, match="tiles_kb"):
        h2d_peak(nbytes=1 << 20, tiles_kb=(2048,))


def test_mapped_read_peak_rejects_bad_sizes_before_touching_cuda():
    with pytest.raises(CeilingError, match="mapped_read_peak nbytes=1000"):
        mapped_read_peak(nbytes=1000)
    with pytest.raises(CeilingError, match="repeats=0"):
        mapped_read_peak(nbytes=1 << 20, repeats=0)


@pytest.mark.gpu
def test_mapped_read_peak_on_gpu():
    """A kernel reads pinned host RAM over PCIe: a rate above nothing and below the device's own HBM, per grid."""
    pytest.importorskip("pycuda")
    r = mapped_read_peak(nbytes=64 << 20, repeats=2)
    assert len(r["grids"]) == 3 and r["GBps"] == max(r["grids"].values())
    assert 1.0 < r["GBps"] < 1000.0


@pytest.mark.gpu
def test_h2d_peak_on_gpu():
    pytest.importorskip("pycuda")
    r = h2d_peak(nbytes=64 << 20, tiles_kb=(64, 512, 4096), repeats=2, tile_samples=8)
    assert set(r) >= {"whole_GBps", "whole_GBps_median", "tiles", "nbytes", "device"}
    assert r["whole_GBps"] > 1.0 and r["whole_GBps"] >= r["whole_GBps_median"]
    assert sorted(r["tiles"]) == [64, 512, 4096]
    for kb, t in r["tiles"].items():
        assert t["GBps"] > 0 and t["tile_us"] > 0 and t["tiles"] == (64 << 20) // (kb << 10)
    # a bigger tile takes longer to move
    assert r["tiles"][4096]["tile_us"] > r["tiles"][64]["tile_us"]


def test_odirect_refused_falls_back_and_says_so(data_file, monkeypatch):
    import errno

    import coli.bench.ceilings as ceil
    real_open = os.open

    def refuse_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(ceil.os, "open", refuse_direct)
    r = odirect_read_peak(data_file, block_mb=(1,), threads=(1,), seconds=0.02)
    assert r["o_direct"] is False and "refused O_DIRECT" in r["note"] and "may serve" in r["page_cache"]
    assert r["table"][0]["bytes"] > 0
