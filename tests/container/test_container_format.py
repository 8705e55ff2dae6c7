"""Readers refuse what they do not accept, naming the file and the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coli.container.format import MANIFEST_NAME, VERSION
from coli.container.reader import ContainerReader
from coli.container.writer import ConvertOptions, convert
from coli.errors import ColiError
from coli.loader import open_weights

from container_cli import coli


@pytest.fixture()
def container(small_fp8, tmp_path) -> Path:
    dst = tmp_path / "c"
    convert(small_fp8, dst, ConvertOptions(experts="int4", dense="int8"))
    return dst


def _edit_manifest(dst: Path, fn) -> None:
    p = dst / MANIFEST_NAME
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def test_loader_opens_a_container(container):
    assert isinstance(open_weights(container), ContainerReader)


@pytest.mark.parametrize("edit,field", [
    (lambda m: m.update(magic="something-else"), "field 'magic'"),
    (lambda m: m.update(format_version=VERSION + 1), "field 'format_version'"),
    (lambda m: m.pop("experts"), "field 'experts' is missing"),
    (lambda m: m["experts"]["record"]["gate_proj"].update(format="int3"), "field 'format'"),
    (lambda m: m["experts"]["record"]["gate_proj"].update(tile_bytes=5), "field 'tile_bytes'"),
    (lambda m: m["dense"]["file"].update(size=5), "field 'size'"),
])
def test_manifest_refusals_name_file_and_field(container, edit, field):
    _edit_manifest(container, edit)
    with pytest.raises(ColiError) as e:
        ContainerReader(container)
    assert MANIFEST_NAME in str(e.value) or "dense.coli" in str(e.value)
    assert field in str(e.value)
    if "magic" in field:   # one CLI round trip is enough: same error, one line, exit 2
        r = coli("run", "--model", container, "--prompt-ids", "0,5,6", "-n", "1")
        assert r.returncode == 2 and field in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("offset,value,field", [(0, b"NOTCOLI!", "field 'magic'"),
                                                (8, (VERSION + 1).to_bytes(4, "little"), "field 'version'")])
def test_data_file_header_refusals(container, offset, value, field):
    fd = os.open(container / "experts-00000.coli", os.O_RDWR)
    os.pwrite(fd, value, offset)
    os.close(fd)
    with pytest.raises(ColiError, match=f"experts-00000.coli: {field}"):
        ContainerReader(container)


def test_damaged_index_and_truncated_file(container):
    idx = container / "experts.index"
    raw = bytearray(idx.read_bytes())
    raw[-1] ^= 1
    idx.write_bytes(bytes(raw))
    with pytest.raises(ColiError, match="experts.index.*damaged index"):
        ContainerReader(container)
    raw[-1] ^= 1
    idx.write_bytes(bytes(raw))
    size = (container / "experts-00000.coli").stat().st_size
    os.truncate(container / "experts-00000.coli", size - 4096)
    with pytest.raises(ColiError, match="experts-00000.coli.*truncated or damaged"):
        ContainerReader(container)


def test_unfinished_conversion_is_not_a_container(small_fp8, tmp_path):
    dst = tmp_path / "c"
    calls = []

    def stop(done, total):
        calls.append(done)
        if len(calls) > 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(small_fp8, dst, ConvertOptions(), progress=stop, threads=1)
    assert not (dst / MANIFEST_NAME).exists()
    with pytest.raises(ColiError, match="not found"):
        ContainerReader(dst)
    r = coli("inspect", dst)
    assert r.returncode == 2 and "unfinished conversion" in r.stderr
