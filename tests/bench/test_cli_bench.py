"""`coli bench make-slice` on the command line: it writes a slice and says its size and time; bad input is one
line naming the culprit (exit 2) and leaves nothing behind; an existing DIR needs --force."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from coli.bench.slice import SliceError, SliceOptions, make_slice
from coli.bench.trace_router import TRACE_NAME
from coli.cli.main import app
from coli.container.check import verify_container
from coli.container.format import MANIFEST_NAME, parse_manifest
from coli.trace import read_trace

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, ["bench", "make-slice", *map(str, args), "--no-progress"])


def test_cli_writes_a_slice_and_reports_size_and_time(tmp_path):
    r = _cli(tmp_path / "s", "--preset", "tiny", "--layers", "2", "--trace", "uniform", "--tokens", "9",
             "--vocab", "100")
    assert r.exit_code == 0, r.output
    assert "tiny slice: 2 MoE layer(s) x 16 experts" in r.output and "slice complete" in r.output
    src = parse_manifest(tmp_path / "s" / MANIFEST_NAME).source
    assert src["vocab"] == 100 and src["vocab_shrunk"] and src["layers"] == 2
    assert read_trace(tmp_path / "s" / TRACE_NAME).n_tokens == 9
    assert runner.invoke(app, ["verify", str(tmp_path / "s"), "--no-progress"]).exit_code == 0


def test_the_slice_stores_its_dense_core_as_convert_does_by_default(tmp_path):
    """A benchmark's dense layer must read what a user's converted model reads: make-slice's default dense format is
    `coli convert --dense`'s (int8), on the command line and in SliceOptions; bf16 stays selectable."""
    import inspect

    from coli.cli.bench import make_slice as cli_make_slice
    from coli.cli.convert import convert as cli_convert
    from coli.container.writer import ConvertOptions
    convert_default = inspect.signature(cli_convert).parameters["dense"].default.default
    assert convert_default == ConvertOptions.dense == SliceOptions().dense_fmt
    assert inspect.signature(cli_make_slice).parameters["dense_fmt"].default.default == convert_default
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    for args, want in (([], convert_default), (["--dense-format", "bf16"], "bf16")):
        d = tmp_path / f"s{len(args)}"
        r = _cli(d, "--preset", "tiny", "--layers", "1", "--trace", "uniform", "--tokens", "2", *args)
        assert r.exit_code == 0, r.output
        m = parse_manifest(d / MANIFEST_NAME)
        assert m.dense[o_proj].layout.fmt == want and m.args["dense"] == want
        assert m.dense["model.layers.0.mlp.gate.weight"].layout.fmt == "f32"      # routers stay f32


@pytest.mark.parametrize("args, culprit", [
    (["--trace", "glm99"], "--trace 'glm99'"),
    (["--trace", "/nonexistent/run.trace"], "--trace '/nonexistent/run.trace'"),
    (["--layers", "0"], "--layers 0"),
    (["--format", "int3"], "--format 'int3'"),
    (["--group", "48"], "--group 48"),
    (["--experts", "2"], "--experts 2"),
    (["--vocab", "100000"], "--vocab 100000"),
    (["--tokens", "0"], "--tokens 0"),
    (["--preset", "huge"], "--preset 'huge'"),
])
def test_bad_options_are_one_line_naming_the_option(tmp_path, args, culprit):
    r = _cli(tmp_path / "s", "--preset", "tiny", *args) if "--preset" not in args else _cli(tmp_path / "s", *args)
    assert r.exit_code == 2 and culprit in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "s").exists() and not (tmp_path / "s.tmp").exists()


def test_existing_dir_needs_force(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "precious.txt").write_text("x")
    r = _cli(d, "--preset", "tiny")
    assert r.exit_code == 2 and f"DIR {d} exists and is not empty" in r.output and "--force" in r.output
    assert (d / "precious.txt").exists()
    r = _cli(d, "--preset", "tiny", "--force")
    assert r.exit_code == 0, r.output
    assert not (d / "precious.txt").exists() and verify_container(d).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]       # nothing left beside it
    (tmp_path / "f").write_text("")
    r = _cli(tmp_path / "f", "--preset", "tiny", "--force")
    assert r.exit_code == 2 and "is not a directory" in r.output


def test_foreign_tmp_dir_is_refused_and_no_space_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "s.tmp").mkdir()
    (tmp_path / "s.tmp" / "mine").write_text("x")
    r = _cli(tmp_path / "s", "--preset", "tiny")
    assert r.exit_code == 2 and "s.tmp exists and was not made by coli bench make-slice" in r.output
    import coli.bench.slice as sl
    monkeypatch.setattr(sl, "_free_bytes", lambda p: 1000)
    with pytest.raises(SliceError, match=r"the slice needs .* 1.00 kB are free"):
        make_slice(tmp_path / "t", SliceOptions(preset="tiny"))
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.tmp").exists()
