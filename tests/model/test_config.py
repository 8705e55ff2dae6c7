import json

import pytest

from coli.config import PRESETS, ModelConfig, config_from_hf_dict, derive_indexer_types, load_config, preset
from coli.errors import ConfigError


def hf(**kw):
    d = {"model_type": "glm_moe_dsa"}
    d.update(kw)
    return d


def test_glm5_defaults_and_derived_sizes():
    c = preset("glm5")
    assert c.num_hidden_layers == 78 and len(c.moe_layers) == 75 and c.dense_layers == [0, 1, 2]
    assert c.qk_head_dim == 256 and c.softmax_scale == 1 / 16
    assert c.kv_values_per_token() == 54912  # reference §3.10
    assert c.eos_token_ids == (154820, 154827, 154829) and c.rope_theta == 1e6


def test_other_model_type_is_refused_by_name():
    with pytest.raises(ConfigError, match="'llama'"):
        config_from_hf_dict({"model_type": "llama"})


def test_indexer_types_derivations():
    assert derive_indexer_types(4, "FFSS") == ("full", "full", "shared", "shared")
    # freq 2, offset 2: i=0,1 full (max(.,0)=0), i=2 -> 1 -> shared, i=3 -> 2 -> full
    assert derive_indexer_types(5, None, 2, 2) == ("full", "full", "shared", "full", "shared")
    c = config_from_hf_dict(hf(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1))
    assert c.indexer_types == ("full", "shared", "full", "shared")
    c = config_from_hf_dict(hf(num_hidden_layers=4, index_topk_pattern="FSFS"))
    assert c.indexer_types == ("full", "shared", "full", "shared")
    with pytest.raises(ConfigError, match="must be 'full'"):
        config_from_hf_dict(hf(num_hidden_layers=2, indexer_types=["shared", "full"]))


def test_mlp_layer_types_and_first_k_dense():
    c = config_from_hf_dict(hf(num_hidden_layers=5, first_k_dense_replace=2))
    assert c.mlp_layer_types == ("dense", "dense", "sparse", "sparse", "sparse")
    c = config_from_hf_dict(hf(num_hidden_layers=3, mlp_layer_types=["sparse", "dense", "sparse"]))
    assert c.moe_layers == [0, 2]


def test_rope_theta_sources_and_eos_forms():
    assert config_from_hf_dict(hf(rope_parameters={"rope_type": "default", "rope_theta": 5e5})).rope_theta == 5e5
    assert config_from_hf_dict(hf(rope_theta=123.0)).rope_theta == 123.0
    assert config_from_hf_dict(hf(eos_token_id=[3, 4])).eos_token_ids == (3, 4)
    assert config_from_hf_dict(hf(eos_token_id=7)).eos_token_ids == (7,)
    with pytest.raises(ConfigError, match="eos_token_id"):
        config_from_hf_dict(hf(eos_token_id="x"))


def test_group_routing_validation():
    assert config_from_hf_dict(hf(n_routed_experts=16, n_group=4, topk_group=2)).n_group == 4
    with pytest.raises(ConfigError, match="divisible"):
        config_from_hf_dict(hf(n_routed_experts=10, n_group=4, topk_group=1))


def test_transformers_config_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("tiny", "tiny-shared", "tiny-groups", "glm5"):
        c = PRESETS[name]
        t = transformers.GlmMoeDsaConfig(**{k: v for k, v in c.to_hf_dict().items() if k not in ("model_type", "architectures")})
        t.save_pretrained(tmp_path / name)
        back = load_config(tmp_path / name)
        assert back == c, name


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(tmp_path)


def test_to_dict_round_trip():
    c = PRESETS["tiny-groups"]
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
