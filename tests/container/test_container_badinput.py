"""Bad input: each case is a clear error naming the file and tensor, and DST is never marked complete."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coli.container.format import MANIFEST_NAME
from coli.container.writer import ConvertOptions, convert
from coli.errors import ColiError
from coli.safetensors_io import SafetensorsFile, write_safetensors

from container_cli import coli, copy_tree

Q_A = "model.layers.1.self_attn.q_a_proj.weight"
EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


def _shard_of(ck: Path, name: str) -> Path:
    return ck / json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite(ck: Path, name: str, replace=None, drop: bool = False) -> Path:
    """Rewrite the shard holding `name` with that tensor replaced by (dtype, array) or dropped."""
    path = _shard_of(ck, name)
    f = SafetensorsFile(path)
    tensors = {n: (t.dtype, np.array(f.raw(n))) for n, t in f.tensors.items()}
    f.close()
    if drop:
        del tensors[name]
    else:
        tensors[name] = replace
    write_safetensors(path, tensors)
    if drop:
        idx = ck / "model.safetensors.index.json"
        m = json.loads(idx.read_text())
        del m["weight_map"][name]
        idx.write_text(json.dumps(m))
    return path


@pytest.fixture()
def ck(small_fp8, tmp_path) -> Path:
    return copy_tree(small_fp8, tmp_path / "src")


def _fails(ck: Path, dst: Path, *patterns: str) -> str:
    with pytest.raises(ColiError) as e:
        convert(ck, dst, ConvertOptions())
    msg = str(e.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    assert not (dst / MANIFEST_NAME).exists()
    return msg


def test_truncated_shard(ck, tmp_path):
    shard = _shard_of(ck, EXPERT)
    os.truncate(shard, shard.stat().st_size - 1000)
    _fails(ck, tmp_path / "c", shard.name, "truncated")
    r = coli("convert", ck, tmp_path / "c2", "--no-progress")
    assert r.returncode == 2 and shard.name in r.stderr and "Traceback" not in r.stderr


def test_absurd_header_length(ck, tmp_path):
    shard = _shard_of(ck, EXPERT)
    with open(shard, "r+b") as f:
        f.write((1 << 62).to_bytes(8, "little"))
    _fails(ck, tmp_path / "c", shard.name, "corrupt header length")


def test_offsets_outside_the_file(ck, tmp_path):
    shard = _shard_of(ck, EXPERT)
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    a, b = header[EXPERT]["data_offsets"]
    header[EXPERT]["data_offsets"] = [len(data) + 64, len(data) + 64 + (b - a)]
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    shard.write_bytes(len(hb).to_bytes(8, "little") + hb + data)
    _fails(ck, tmp_path / "c", shard.name, EXPERT, "outside the file")


def test_missing_tensor(ck, tmp_path):
    _rewrite(ck, EXPERT, drop=True)
    _fails(ck, tmp_path / "c", EXPERT, "missing")


def test_shape_that_does_not_match_the_config(ck, tmp_path):
    shard = _rewrite(ck, Q_A, ("F8_E4M3", np.zeros((100, 256), np.uint8)))
    _fails(ck, tmp_path / "c", shard.name, Q_A, "[100, 256]", "[192, 256]")


def test_unsupported_dtype(ck, tmp_path):
    shard = _rewrite(ck, "model.layers.1.mlp.gate.weight", ("I32", np.zeros((4, 256), np.int32)))
    _fails(ck, tmp_path / "c", shard.name, "model.layers.1.mlp.gate.weight", "dtype I32")
    # a dtype string the reader does not know at all
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hb = raw[8:8 + n].replace(b'"I32"', b'"F4X"')
    shard.write_bytes(raw[:8] + hb + raw[8 + n:])
    _fails(ck, tmp_path / "c2", shard.name, "model.layers.1.mlp.gate.weight", "unsupported dtype 'F4X'")


def test_fp8_without_scale_companion(ck, tmp_path):
    _rewrite(ck, Q_A + "_scale_inv", drop=True)
    _fails(ck, tmp_path / "c", Q_A, "weight_scale_inv")


def test_fp8_scale_with_wrong_grid(ck, tmp_path):
    shard = _rewrite(ck, Q_A + "_scale_inv", ("F32", np.ones((1, 2), np.float32)))
    _fails(ck, tmp_path / "c", shard.name, Q_A + "_scale_inv", "[2, 2]")


def test_nan_weights(ck, tmp_path):
    path = _shard_of(ck, "model.layers.1.mlp.gate.weight")
    f = SafetensorsFile(path)
    w = np.array(f.raw("model.layers.1.mlp.gate.weight"))
    f.close()
    w[1, 1] = 0x7FC0                                       # bf16 NaN
    _rewrite(ck, "model.layers.1.mlp.gate.weight", ("BF16", w))
    _fails(ck, tmp_path / "c", path.name, "model.layers.1.mlp.gate.weight", "NaN")


def test_dst_equal_to_or_inside_src(ck):
    with pytest.raises(ColiError, match="is the source checkpoint"):
        convert(ck, ck, ConvertOptions())
    with pytest.raises(ColiError, match="inside the source checkpoint"):
        convert(ck, ck / "out", ConvertOptions())
    assert not (ck / "out").exists()
    r = coli("convert", ck, ck / "sub" / "out", "--no-progress")
    assert r.returncode == 2 and "inside the source checkpoint" in r.stderr


def _limit_fsize(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # write() then fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def test_no_space_left_then_resume(small_fp8, tmp_path):
    """A file-size limit (RLIMIT_FSIZE) stands in for a full disk: both make write() fail mid-conversion."""
    dst, ref = tmp_path / "c", tmp_path / "ref"
    convert(small_fp8, ref, ConvertOptions(experts="bf16", dense="bf16"))
    limit = (ref / "dense.coli").stat().st_size // 2
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "convert", str(small_fp8), str(dst), "--experts", "bf16",
                        "--dense", "bf16", "--no-progress"], capture_output=True, text=True, preexec_fn=_limit_fsize(limit))
    assert r.returncode == 2, r.stderr
    assert "dense.coli" in r.stderr and "tensor '" in r.stderr and "rerun the same command to resume" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (dst / MANIFEST_NAME).exists()
    r = coli("convert", small_fp8, dst, "--experts", "bf16", "--dense", "bf16", "--no-progress", check=True)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == {p.name: p.read_bytes() for p in ref.iterdir()}
