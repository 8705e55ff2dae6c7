"""coli.bench.plots writes PNGs with matplotlib (Agg); without it, a PlotsUnavailable naming matplotlib and how
to install it (the `[bench]` extra), said once by the bench."""

from __future__ import annotations

import builtins
import sys

import pytest

from coli.bench import plots

PNG = b"\x89PNG\r\n\x1a\n"

CEIL = {"whole_GBps": 52.1, "whole_GBps_median": 51.0,
        "tiles": {64: {"GBps": 9.5, "tile_us": 8.1}, 512: {"GBps": 40.2, "tile_us": 13.0},
                  4096: {"GBps": 51.8, "tile_us": 81.0}}}
EVENTS = [{"lane": "compute", "t0_us": 1000 + 300 * i, "t1_us": 1250 + 300 * i, "label": f"L{i}"} for i in range(6)] + [
    {"lane": "demand", "t0_us": 1100, "t1_us": 1500, "label": "e17"},
    {"lane": "speculative", "t0_us": 900, "t1_us": 2400, "label": "e3 e9 e120"},
    {"lane": "demand", "t0_us": 2000, "t1_us": 2001, "label": ""}]
ROWS = [{"name": "resident", "tokens_per_s": 30.2, "ceiling_tokens_per_s": 31.0},
        {"name": "stream lru", "tokens_per_s": 4.1, "ceiling_tokens_per_s": 6.0},
        {"name": "stream failed", "tokens_per_s": None, "ceiling_tokens_per_s": 6.0},
        {"name": "accelerate peer", "tokens_per_s": 0.4, "baseline": True},
        {"name": "cpu", "tokens_per_s": 0.9, "baseline": True}]


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    for fn, arg, name in ((plots.plot_h2d_tiles, CEIL, "h2d.png"), (plots.plot_timeline, EVENTS, "tl.png"),
                          (plots.plot_scenarios, ROWS, "sub/scen.png")):
        p = fn(arg, tmp_path / name)
        assert p == tmp_path / name and p.read_bytes()[:8] == PNG and p.stat().st_size > 5000


def test_plots_reject_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="tiles"):
        plots.plot_h2d_tiles({"whole_GBps": 1.0}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="event 0 lacks"):
        plots.plot_timeline([{"lane": "demand", "t0_us": 0}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="ends before"):
        plots.plot_timeline([{"lane": "demand", "t0_us": 5, "t1_us": 1}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="row 0"):
        plots.plot_scenarios([{"tokens_per_s": 1}], tmp_path / "x.png")


def _block_matplotlib(monkeypatch):
    """Make `import matplotlib` fail for this test, as on a machine without the [bench] extra."""
    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    for m in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setattr(builtins, "__import__", no_mpl)


def test_without_matplotlib_the_error_names_it(tmp_path, monkeypatch):
    _block_matplotlib(monkeypatch)
    with pytest.raises(plots.PlotsUnavailable, match="matplotlib"):
        plots.plot_scenarios(ROWS, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_the_bench_says_once_how_to_install_it(tmp_path, monkeypatch):
    from coli.bench import stream

    _block_matplotlib(monkeypatch)
    assert "pip install -e '.[bench]'" in plots.missing()
    with pytest.raises(plots.PlotsUnavailable, match=r"\.\[bench\]"):
        plots.plot_timeline(EVENTS, tmp_path / "tl.png")
    said: list[str] = []
    res = {"notes": [], "rows": [{"scenario": "cold-ram", "tokens_per_s": 3.0, "timeline": EVENTS}]}
    stream._plots(res, tmp_path / "plots", None, said.append)
    assert len(said) == 1 and "matplotlib is not installed (pip install -e '.[bench]'" in said[0], said
    assert res["notes"] == [f"no plots: {said[0][len('no plots: '):]}"]
    assert not list((tmp_path / "plots").glob("*.png"))


def test_plots_report_none_missing_where_matplotlib_is_installed():
    pytest.importorskip("matplotlib")
    assert plots.missing() is None
