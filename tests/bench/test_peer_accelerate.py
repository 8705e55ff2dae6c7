"""coli.bench.peer_accelerate on the CPU: a tiny-preset slice's config built on meta, materialised with random bf16
weights, greedy decode of N tokens (no offload, so no bytes moved); the CLI writes the same dict as JSON."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from coli.bench.peer_accelerate import main, run_peer  # noqa: E402

KEYS = {"peer", "device", "vram_gb", "slice", "layers", "tokens", "prompt_len", "weights", "setup_s", "build_s",
        "materialise_s", "dispatch_s", "param_bytes", "prefill_s", "decode_s", "decode_step_s", "tokens_per_s",
        "h2d_bytes_per_token", "h2d_bytes_basis", "offloaded_modules", "offloaded_forwards_per_token",
        "device_map_summary", "peak_vram_gb", "generated", "versions"}


def test_run_peer_cpu(tiny_slice):
    r = run_peer(tiny_slice, vram_gb=16, tokens=3, prompt_len=5, device="cpu")
    assert "error" not in r, r.get("traceback")
    assert set(r) == KEYS
    assert r["layers"] == 1 and r["tokens"] == 3 and len(r["generated"]) == 4
    assert len(r["decode_step_s"]) == 3 and r["decode_s"] == pytest.approx(sum(r["decode_step_s"]))
    assert r["tokens_per_s"] == pytest.approx(3 / r["decode_s"])
    assert r["h2d_bytes_per_token"] == 0 and r["offloaded_modules"] == {} and r["peak_vram_gb"] is None
    assert r["param_bytes"] > 0 and r["setup_s"] >= r["materialise_s"] > 0
    assert all(0 <= t < 512 for t in r["generated"])


def test_run_peer_errors_are_returned_not_raised(tiny_slice, tmp_path):
    assert run_peer(tiny_slice, 16, 0, device="cpu")["stage"] == "options"
    assert run_peer(tiny_slice, 16, 2, device="tpu")["stage"] == "options"
    r = run_peer(tmp_path / "nothing", 16, 2, device="cpu")
    assert r["stage"] == "config" and "config.json" in r["error"]


def test_cli_writes_json(tiny_slice, tmp_path):
    out = tmp_path / "peer.json"
    assert main([str(tiny_slice), "--device", "cpu", "--tokens", "2", "--prompt-len", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 2 and len(r["generated"]) == 3 and r["h2d_bytes_per_token"] == 0
