"""scripts/bench_mtp.py on the demo model (numpy backend, a few tokens): its JSON keeps the keys earlier results
have and adds the steady state apart from each run's warm-up; the split itself on given token times."""

from __future__ import annotations

import json

import pytest

import bench_mtp
from bench_mtp import split_steady

OLD_MODE_KEYS = {"decode_tokens_per_s", "speedup_vs_off", "tokens_per_step", "acceptance_per_position"}


def test_split_steady_puts_the_first_tokens_apart():
    times = [0.0, 1.0, 1.5, 2.0, 2.1, 2.2, 2.3]          # token 0 from the prefill, then slow first steps
    assert split_steady(times, 3) == pytest.approx((2.0, 3, 0.3))
    assert split_steady(times, 0) == pytest.approx((0.0, 6, 2.3))
    assert split_steady(times, 99) == pytest.approx((2.3, 0, 0.0))      # no steady part: all warm-up
    assert split_steady([5.0], 3) == (0.0, 0, 0.0)


def test_the_bench_reports_steady_state_beside_its_old_figures(tmp_path, capsys):
    out = tmp_path / "mtp.json"
    assert bench_mtp.main(["--tokens", "10", "--warmup-tokens", "3", "--repeat", "1", "--modes", "off,1",
                           "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 10 and r["warmup_tokens"] == 3
    for m in ("off", "1"):
        mode = r["modes"][m]
        assert OLD_MODE_KEYS <= set(mode)
        assert mode["steady_tokens_per_s"] > 0 and mode["warmup_s"] > 0 and mode["captures"] == 0   # numpy: no graphs
    assert r["modes"]["off"]["steady_speedup_vs_off"] == 1.0
    one = r["prompts"]["heldout"][bench_mtp.HELDOUT[0]]["1"]
    assert one["steady_tokens_per_s"] > 0 and one["mtp"]["rounds"] > 0


def test_the_bench_refuses_a_run_too_short_to_time(capsys):
    assert bench_mtp.main(["--tokens", "1", "--modes", "off"]) == 2
    assert "--tokens must be >= 2" in capsys.readouterr().err
