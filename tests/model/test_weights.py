import json

import numpy as np
import pytest

from checkpoints import checkpoint_tensors, write_checkpoint
from coli.config import PRESETS
from coli.errors import WeightError
from coli.safetensors_io import E4M3_TABLE, SafetensorsFile, bf16_to_f32, f32_to_bf16_bits, write_safetensors
from coli.weights import HFCheckpoint, dequant_fp8_blocks

C = PRESETS["tiny"]


def test_sharded_checkpoint_with_mtp_layer(tmp_path):
    t = checkpoint_tensors(C, mtp=True)
    d = write_checkpoint(tmp_path / "m", C, t, shards=3)
    notes = []
    ck = HFCheckpoint(d, report=notes.append)
    assert ck.skipped_layers == [C.num_hidden_layers] and len(notes) == 1 and "MTP" in notes[0]
    name = "model.layers.1.self_attn.q_b_proj.weight"
    np.testing.assert_array_equal(ck.dense(name), t[name])
    ew = ck.expert(2, 5)
    np.testing.assert_array_equal(ew.down, t["model.layers.2.mlp.experts.5.down_proj.weight"])


def test_missing_tensor_is_named(tmp_path):
    t = checkpoint_tensors(C)
    del t["model.layers.3.mlp.experts.11.up_proj.weight"]
    d = write_checkpoint(tmp_path / "m", C, t)
    with pytest.raises(WeightError, match=r"model\.layers\.3\.mlp\.experts\.11\.up_proj\.weight.*missing"):
        HFCheckpoint(d)


def test_misshaped_tensor_is_named(tmp_path):
    t = checkpoint_tensors(C)
    t["model.layers.0.self_attn.o_proj.weight"] = np.zeros((3, 4), np.float32)
    d = write_checkpoint(tmp_path / "m", C, t)
    with pytest.raises(WeightError, match=r"o_proj\.weight.*shape \[3, 4\].*\[128, 128\]"):
        HFCheckpoint(d)


def test_index_naming_a_missing_shard(tmp_path):
    d = write_checkpoint(tmp_path / "m", C, checkpoint_tensors(C), shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightError, match="model-00002-of-00002.safetensors"):
        HFCheckpoint(d)


def test_corrupt_headers(tmp_path):
    p = tmp_path / "x.safetensors"
    write_safetensors(p, {"a": ("F32", np.ones((4, 4), np.float32))})
    good = p.read_bytes()
    p.write_bytes((10 ** 12).to_bytes(8, "little") + good[8:])
    with pytest.raises(WeightError, match="corrupt header length"):
        SafetensorsFile(p)
    p.write_bytes(good[:-10])
    with pytest.raises(WeightError, match="outside the file"):
        SafetensorsFile(p)
    p.write_bytes(good[:5])
    with pytest.raises(WeightError, match="truncated"):
        SafetensorsFile(p)
    hdr = json.dumps({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    p.write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"\0" * 8)
    with pytest.raises(WeightError, match="unsupported dtype 'C64'"):
        SafetensorsFile(p)


def test_bf16_and_e4m3_conversions():
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0], np.float32)
    back = bf16_to_f32(f32_to_bf16_bits(x))
    np.testing.assert_allclose(back, x, rtol=2 ** -8)
    torch = pytest.importorskip("torch")
    allv = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(np.isnan(allv), np.isnan(E4M3_TABLE))
    np.testing.assert_array_equal(allv[~np.isnan(allv)], E4M3_TABLE[~np.isnan(E4M3_TABLE)])
    tb = torch.tensor(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(f32_to_bf16_bits(x), tb)


def test_fp8_block_dequant_with_ragged_edges():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((576, 200)).astype(np.float32)
    s = rng.random((5, 2)).astype(np.float32)
    out = dequant_fp8_blocks(w, s)
    assert out[575, 199] == w[575, 199] * s[4, 1] and out[127, 128] == w[127, 128] * s[0, 1]
    assert out[512, 0] == w[512, 0] * s[4, 0]
    with pytest.raises(WeightError, match=r"expected \(5, 2\)"):
        dequant_fp8_blocks(w, s[:4])
