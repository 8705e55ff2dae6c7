"""Tests for scripts/make_oracle.py, the transformers reference ("oracle") builder.

Builds the default oracle once (about 2 s on one CPU thread) plus two more small builds; total well under 30 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_oracle  # noqa: E402

# A real, naturally unsafe oracle (no monkeypatching): with seed 1234 the default model's greedy step 17 has a
# top-1/top-2 logit margin of 3.5e-5 < 1e-4 (transformers 5.23 / torch 2.13, fp32). With the full default lengths
# seed 1234 also has an indexer boundary gap of 6e-7; 18 new tokens are enough and keep the test cheap.
UNSAFE_SEED = 1234
UNSAFE_ARGS = ["--seed", str(UNSAFE_SEED), "--new-tokens", "18", "--continue-tokens", "1"]
UNSAFE_KWARGS = dict(seed=UNSAFE_SEED, new_tokens=18, continue_tokens=1)

torch.set_num_threads(1)


def _leftovers(parent: Path, name: str) -> list:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


@pytest.fixture(scope="module")
def default_oracle(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle") / "default"
    info = make_oracle.build_oracle(out)
    return out, info


def test_default_oracle_files(default_oracle):
    out, info = default_oracle
    d = make_oracle.DEFAULTS
    for name in ("config.json", "generation_config.json", "model.safetensors", "oracle.json",
                 "oracle_logits.npy", "continuation_logits.npy"):
        assert (out / name).is_file(), name
    assert not _leftovers(out.parent, out.name)

    on_disk = json.loads((out / "oracle.json").read_text())
    assert on_disk == json.loads(json.dumps(info))
    assert on_disk["oracle_safe"] is True
    assert on_disk["seed"] == d["seed"]
    assert on_disk["options"] == {**d, "indexer_pattern": "F" * d["layers"]}
    assert set(on_disk) >= {"seed", "options", "prompt_ids", "greedy_tokens", "continuation", "safety",
                            "oracle_safe", "transformers_version", "torch_version"}

    prompt = on_disk["prompt_ids"]
    assert len(prompt) == d["prompt_len"] and prompt[0] == 0
    assert all(2 <= t < d["vocab"] for t in prompt[1:])
    extra = on_disk["continuation"]["extra_ids"]
    assert len(extra) == d["continue_tokens"] and all(2 <= t < d["vocab"] for t in extra)

    for key, fname in (("greedy_tokens", "oracle_logits.npy"), ("continuation", "continuation_logits.npy")):
        toks = on_disk[key] if key == "greedy_tokens" else on_disk[key]["greedy_tokens"]
        logits = np.load(out / fname)
        assert logits.dtype == np.float32 and logits.shape == (d["new_tokens"], d["vocab"])
        assert len(toks) == d["new_tokens"]
        assert logits.argmax(-1).tolist() == toks
    exact = np.load(out / "oracle_logits_f64.npy")           # the same steps teacher-forced in float64
    assert exact.dtype == np.float64 and exact.shape == (d["new_tokens"], d["vocab"])
    assert exact.argmax(-1).tolist() == on_disk["greedy_tokens"]

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa"
    assert cfg["index_topk"] == d["index_topk"] and cfg["n_routed_experts"] == d["experts"]
    assert cfg["num_hidden_layers"] == d["layers"] and cfg["first_k_dense_replace"] == d["dense_layers"]
    assert cfg["index_n_heads"] == 32 and cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["eos_token_id"] == 1 and cfg["pad_token_id"] is None and cfg["tie_word_embeddings"] is False

    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "np") as f:
        keys = set(f.keys())
        # per-expert names on disk, fp32, randomised norms / correction bias
        assert "model.layers.1.mlp.experts.15.gate_proj.weight" in keys
        assert "model.layers.1.mlp.experts.gate_up_proj" not in keys
        assert f.get_tensor("model.norm.weight").dtype == np.float32
        assert np.abs(f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")).max() > 0
        assert np.abs(f.get_tensor("model.norm.weight") - 1).max() > 0
        assert np.abs(f.get_tensor("model.layers.0.self_attn.indexer.k_norm.bias")).max() > 0


def test_default_oracle_is_safe_and_sparse(default_oracle):
    _, info = default_oracle
    s = info["safety"]
    thr = make_oracle.THRESHOLDS
    assert s["sparse_rows"] > 0  # the indexer really selected (rows with more visible keys than index_topk)
    assert s["min_indexer_rel_gap"] > thr["indexer_rel_gap"]
    assert s["min_router_gap"] > thr["router_gap"]
    assert s["min_group_gap"] is None  # n_group = 1
    assert s["min_logit_margin"] > thr["logit_margin"]
    assert s["cache_nocache_max_logit_diff"] <= thr["cache_nocache_logit_diff"]
    assert s["reload_max_logit_diff"] <= thr["reload_logit_diff"]
    assert s["failures"] == [] and s["n_failures"] == 0


def test_existing_dir_is_refused(default_oracle, capsys):
    out, _ = default_oracle
    before = (out / "oracle.json").read_bytes()
    with pytest.raises(FileExistsError):
        make_oracle.build_oracle(out)
    assert make_oracle.main(["--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "oracle.json").read_bytes() == before


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(indexer_pattern="SFFF"), "layer 0 must be F"),
        (dict(indexer_pattern="FFS"), "expected layers=4"),
        (dict(indexer_pattern="FXFF"), "only contain F"),
        (dict(prompt_len=8), "must be > index_topk"),
        (dict(experts=16, n_group=3), "divisible by n_group"),
        (dict(topk=17), "topk must be in"),
        (dict(n_group=2, topk_group=3), "topk_group must be in"),
        (dict(dense_layers=5), "dense_layers"),
    ],
)
def test_invalid_options_are_refused(tmp_path, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        make_oracle.build_oracle(tmp_path / "x", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_cli_invalid_pattern(tmp_path, capsys):
    assert make_oracle.main(["--out", str(tmp_path / "x"), "--indexer-pattern", "SFSF"]) == 2
    assert "layer 0 must be F" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_unsafe_seed_is_refused_and_force_keeps_old_dir(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "marker").write_text("old")
    rc = make_oracle.main(["--out", str(out), *UNSAFE_ARGS, "--force"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "oracle unsafe" in err and "logit_margin" in err and "position 37" in err
    assert sorted(p.name for p in out.iterdir()) == ["marker"]  # untouched
    assert not _leftovers(tmp_path, "o")


def test_unsafe_seed_without_check_is_flagged(tmp_path):
    with pytest.raises(make_oracle.OracleUnsafe, match="logit_margin"):
        make_oracle.build_oracle(tmp_path / "r", **UNSAFE_KWARGS)
    assert list(tmp_path.iterdir()) == []
    info = make_oracle.build_oracle(tmp_path / "u", **UNSAFE_KWARGS, check_safety=False)
    assert info["oracle_safe"] is False
    s = info["safety"]
    assert s["n_failures"] > 0
    checks = {f["check"] for f in s["failures"]}
    assert "logit_margin" in checks
    assert checks <= {"indexer_rel_gap", "router_gap", "group_gap", "logit_margin", "cache_nocache", "reload"}
    assert all(f["value"] <= f["threshold"] for f in s["failures"])
    assert json.loads((tmp_path / "u" / "oracle.json").read_text())["oracle_safe"] is False


def test_force_replaces_existing_dir(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "marker").write_text("old")
    rc = make_oracle.main(["--out", str(out), "--force", "--new-tokens", "8", "--continue-tokens", "3",
                           "--indexer-pattern", "FFSS"])
    assert rc == 0, capsys.readouterr().err
    assert not (out / "marker").exists()
    info = json.loads((out / "oracle.json").read_text())
    assert info["oracle_safe"] and info["options"]["indexer_pattern"] == "FFSS"
    assert np.load(out / "oracle_logits.npy").shape == (8, 512)
    assert not _leftovers(tmp_path, "o")
