"""Writer -> reader round trips, raw record decoding, determinism, coli run from a container, inspect, verify."""

from __future__ import annotations

import json
import os
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from coli.container.format import MANIFEST_NAME, RecordLayout
from coli.container.reader import ContainerReader, decode_expert_record, verify_record
from coli.container.writer import ConvertOptions, convert
from coli.errors import ColiError
from coli.model.tensors import keep_full_precision
from coli.weights import HFCheckpoint

from container_cli import coli


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_f32_container_is_exact(fp8_ckpt, tmp_path):
    dst = tmp_path / "c"
    r = convert(fp8_ckpt, dst, ConvertOptions(experts="f32", dense="f32", expert_file_mb=1))
    assert r.status == "converted" and (dst / MANIFEST_NAME).is_file()
    ck, rd = HFCheckpoint(fp8_ckpt), ContainerReader(dst)
    assert len(rd.manifest.expert_files) > 1                 # split into several files
    for name in rd.dense_names():
        assert np.array_equal(rd.dense(name), ck.dense(name)), name
    for layer in rd.config.moe_layers:
        got, want = rd.experts(layer, range(16)), ck.experts(layer, range(16))
        for e in range(16):
            for part in ("gate", "up", "down"):
                assert np.array_equal(getattr(got[e], part), getattr(want[e], part))
    # the MTP layer (layer 4) is kept, exactly: its dense tensors and its experts as records of layer 4
    assert rd.mtp_layer == 4 and ck.mtp_layer == 4
    assert {n for n in rd.dense_names() if n.startswith("model.layers.4.")} == set(ck.mtp_names()) - {
        n for n in ck.mtp_names() if ".mlp.experts." in n or n.endswith("_scale_inv")}
    got, want = rd.experts(4, range(16)), ck.experts(4, range(16))
    for e in range(16):
        for part in ("gate", "up", "down"):
            assert np.array_equal(getattr(got[e], part), getattr(want[e], part))
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {p.name for p in dst.iterdir()}


@pytest.mark.parametrize("experts,dense,tol", [("int4", "int8", 0.02), ("int8", "int4", 0.02), ("int2", "int2", 0.06),
                                               ("bf16", "bf16", 1e-3)])
def test_quantised_container_round_trip(fp8_ckpt, tmp_path, experts, dense, tol):
    dst = tmp_path / "c"
    convert(fp8_ckpt, dst, ConvertOptions(experts=experts, dense=dense, group=32, tile_kb=8))
    ck, rd = HFCheckpoint(fp8_ckpt), ContainerReader(dst)
    for name in rd.dense_names():
        a, b = rd.dense(name), ck.dense(name)
        if keep_full_precision(name) or a.ndim == 1:
            assert rd.dense_layout(name).fmt == "f32" and np.array_equal(a, b), name
        else:
            assert rd.dense_layout(name).fmt == dense
            assert np.abs(a - b).max() <= tol * max(1.0, float(np.abs(b).max()) / 0.1), name
    e = rd.expert(2, 9)
    w = ck.expert(2, 9)
    for part in ("gate", "up", "down"):
        assert np.abs(getattr(e, part) - getattr(w, part)).max() <= tol


def test_raw_record_decodes_from_shared_memory(fp8_ckpt, tmp_path):
    dst = tmp_path / "c"
    convert(fp8_ckpt, dst, ConvertOptions(experts="int4", dense="bf16", tile_kb=16))
    rd = ContainerReader(dst)
    loc = rd.record_location(3, 11)
    assert loc.offset % 4096 == 0 and loc.length % 4096 == 0 and loc.length == rd.record_layout.nbytes
    fd = os.open(loc.path, os.O_RDONLY)
    try:
        raw = os.pread(fd, loc.length, loc.offset)
    finally:
        os.close(fd)
    shm = shared_memory.SharedMemory(create=True, size=loc.length + 4096)
    try:
        slot = np.ndarray((loc.length,), np.uint8, buffer=shm.buf, offset=4096)
        slot[:] = np.frombuffer(raw, np.uint8)
        verify_record(slot, loc.xxh64)
        got = decode_expert_record(slot, rd.record_layout)
        want = rd.expert(3, 11)
        for part in ("gate", "up", "down"):
            assert np.array_equal(getattr(got, part), getattr(want, part))
        layout = RecordLayout.from_dict(json.loads((dst / MANIFEST_NAME).read_text())["experts"]["record"], "test")
        assert layout == rd.record_layout
        del slot, got
    finally:
        shm.close()
        shm.unlink()


def test_conversion_is_deterministic(small_fp8, tmp_path):
    opts = ConvertOptions(experts="int4", dense="int8", tile_kb=8)
    convert(small_fp8, tmp_path / "a", opts, threads=1)
    convert(small_fp8, tmp_path / "b", opts, threads=2)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_rerun_on_complete_container_is_a_no_op(small_fp8, tmp_path):
    dst = tmp_path / "c"
    convert(small_fp8, dst, ConvertOptions())
    before = _files(dst)
    assert convert(small_fp8, dst, ConvertOptions()).status == "already complete"
    assert _files(dst) == before
    with pytest.raises(ColiError, match=r"--experts int4 \(now int8\)"):
        convert(small_fp8, dst, ConvertOptions(experts="int8"))


def test_coli_run_from_container_equals_hf_dir(f32_ckpt, tmp_path):
    dst = tmp_path / "c"
    coli("convert", f32_ckpt, dst, "--experts", "f32", "--dense", "f32", "--no-progress", check=True)
    prompt = "0," + ",".join(str(i) for i in range(40, 59))          # 20 tokens > index_topk 8
    a = coli("run", "--model", f32_ckpt, "--prompt-ids", prompt, "-n", "12", "--json", "--ignore-eos", check=True)
    b = coli("run", "--model", dst, "--prompt-ids", prompt, "-n", "12", "--json", "--ignore-eos", check=True)
    ta, tb = json.loads(a.stdout)["tokens"], json.loads(b.stdout)["tokens"]
    assert len(ta) == 12 and ta == tb
    # the copied tokenizer works from the container too
    c = coli("run", "--model", dst, "--prompt", "w5 w9 w13", "-n", "3", "--json", check=True)
    assert json.loads(c.stdout)["text"].startswith("w")


def test_inspect_and_verify(small_fp8, tmp_path):
    dst = tmp_path / "c"
    coli("convert", small_fp8, dst, "--experts", "int4", "--group", "32", "--dense", "int8", check=True)
    s = json.loads(coli("inspect", dst, "--json", check=True).stdout)
    assert s["formats"]["experts"] == "int4 g32" and s["formats"]["dense"] == "int8"
    # layer 2 is the MTP layer (small_fp8 has 2 layers): kept, its experts after the main layer's
    assert s["experts_per_layer"] == [{"layer": 1, "experts": 4, "files": ["experts-00000.coli"]},
                                      {"layer": 2, "experts": 4, "files": ["experts-00000.coli"]}]
    rec = s["record"]["bytes"]
    assert s["bytes_per_token_cold"]["routed"] == 2 * 1 * rec       # the main model's: the MTP layer is per draft
    assert s["tiers"]["expert_store_bytes"] == 4096 + 8 * rec
    assert s["mtp"]["layer"] == 2 and s["mtp"]["expert_bytes"] == 4 * rec and s["mtp"]["bytes_per_draft_cold"] == 2 * rec
    human = coli("inspect", dst, check=True).stdout
    assert "bytes per token, cold" in human and "experts per layer" in human and "MTP layer: layer 2" in human
    v = coli("verify", dst, "--no-progress")
    assert v.returncode == 0 and "OK" in v.stdout and "MTP layer 2 included" in v.stdout


def test_no_mtp_leaves_the_mtp_layer_out(small_fp8, tmp_path):
    dst = tmp_path / "c"
    r = coli("convert", small_fp8, dst, "--experts", "int4", "--no-mtp", "--no-progress", check=True)
    assert "--no-mtp" in r.stderr
    s = json.loads(coli("inspect", dst, "--json", check=True).stdout)
    assert s["mtp"] is None and [row["layer"] for row in s["experts_per_layer"]] == [1]
    assert "MTP layer: none" in coli("inspect", dst, check=True).stdout
    rd = ContainerReader(dst)
    assert rd.mtp_layer is None and not any(n.startswith("model.layers.2.") for n in rd.dense_names())
    assert "no MTP layer" in coli("verify", dst, "--no-progress", check=True).stdout


def test_flipped_byte_in_an_mtp_record_is_caught(small_fp8, tmp_path):
    dst = tmp_path / "c"
    convert(small_fp8, dst, ConvertOptions(experts="int4"))
    loc = ContainerReader(dst).record_location(2, 3)           # layer 2 = the MTP layer
    _flip(Path(loc.path), loc.offset + 100)
    v = coli("verify", dst, "--no-progress")
    assert v.returncode == 1 and f"record layer 2 expert 3 at offset {loc.offset}" in v.stderr


def test_a_container_with_part_of_the_mtp_layer_is_refused(small_fp8, tmp_path):
    dst = tmp_path / "c"
    convert(small_fp8, dst, ConvertOptions(experts="int4"))
    raw = json.loads((dst / MANIFEST_NAME).read_text())
    del raw["dense"]["tensors"]["model.layers.2.eh_proj.weight"]
    (dst / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(ColiError, match=r"dense\.tensors.*missing \['model\.layers\.2\.eh_proj\.weight'\]"):
        ContainerReader(dst)


def _flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), offset)
    finally:
        os.close(fd)


def test_flipped_byte_in_a_record_is_caught(small_fp8, tmp_path):
    dst = tmp_path / "c"
    convert(small_fp8, dst, ConvertOptions(experts="int4"))
    rd = ContainerReader(dst)
    loc = rd.record_location(1, 2)
    _flip(Path(loc.path), loc.offset + loc.length // 2)
    v = coli("verify", dst, "--no-progress")
    assert v.returncode == 1
    assert f"experts-00000.coli: record layer 1 expert 2 at offset {loc.offset}" in v.stderr
    rd2 = ContainerReader(dst)
    with pytest.raises(ColiError, match=rf"record layer 1 expert 2 at offset {loc.offset}.*checksum mismatch"):
        rd2.experts(1, [2])
    rd2.experts(1, [0, 1, 3])                                   # the others still load
    j = json.loads(coli("verify", dst, "--json").stdout)
    assert not j["ok"] and j["bad"][0]["offset"] == loc.offset


def test_flipped_byte_in_the_dense_core_is_caught(small_fp8, tmp_path):
    dst = tmp_path / "c"
    convert(small_fp8, dst, ConvertOptions())
    rd = ContainerReader(dst)
    e = rd.manifest.dense["model.layers.0.self_attn.q_b_proj.weight"]
    _flip(dst / "dense.coli", e.layout.offset + 5)
    v = coli("verify", dst, "--no-progress")
    assert v.returncode == 1 and "tensor 'model.layers.0.self_attn.q_b_proj.weight'" in v.stderr
    with pytest.raises(ColiError, match="q_b_proj.*checksum mismatch"):
        ContainerReader(dst).dense("model.layers.0.self_attn.q_b_proj.weight")


def test_bf16_source_is_lossless_in_bf16(tmp_path):
    import make_fp8_checkpoint as mk
    src = tmp_path / "src"
    mk.build_checkpoint(src, seed=9, weight_dtype="bf16", layers=2, dense_layers=1, experts=4, topk=2, tokenizer=False)
    dst = tmp_path / "c"
    convert(src, dst, ConvertOptions(experts="bf16", dense="bf16"))
    ck, rd = HFCheckpoint(src), ContainerReader(dst)
    for name in rd.dense_names():
        assert np.array_equal(rd.dense(name), ck.dense(name)), name
    for e in range(4):
        got, want = rd.expert(1, e), ck.expert(1, e)
        assert all(np.array_equal(getattr(got, p), getattr(want, p)) for p in ("gate", "up", "down"))


def test_fused_expert_checkpoint(small_fp8, tmp_path):
    """A checkpoint saved in transformers' in-memory layout (gate_up_proj [E, 2Im, H], down_proj [E, H, Im])."""
    from coli.safetensors_io import write_safetensors
    ck = HFCheckpoint(small_fp8)
    c = ck.config
    tensors = {}
    for name in ck.names():
        if ".mlp.experts." in name or name.endswith("_scale_inv"):
            continue
        tensors[name] = ("F32", ck.dense(name))
    for layer in c.moe_layers:
        ex = ck.experts(layer, range(c.n_routed_experts))
        p = f"model.layers.{layer}.mlp.experts."
        tensors[p + "gate_up_proj"] = ("F32", np.stack([np.concatenate([ex[e].gate, ex[e].up]) for e in ex]))
        tensors[p + "down_proj"] = ("F32", np.stack([ex[e].down for e in ex]))
    src = tmp_path / "fused"
    src.mkdir()
    write_safetensors(src / "model.safetensors", tensors)
    (src / "config.json").write_bytes((small_fp8 / "config.json").read_bytes())
    dst = tmp_path / "c"
    convert(src, dst, ConvertOptions(experts="f32", dense="f32"))
    rd = ContainerReader(dst)
    for e in range(c.n_routed_experts):
        got, want = rd.expert(1, e), ck.expert(1, e)
        assert all(np.array_equal(getattr(got, p), getattr(want, p)) for p in ("gate", "up", "down"))
