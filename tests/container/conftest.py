"""Fixtures for the container tests: synthetic checkpoints in the GLM-5-FP8 hub layout (scripts/
make_fp8_checkpoint.py, numpy only) and a helper that runs the `coli` CLI in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

import make_fp8_checkpoint as mk

# Small enough to convert in a fraction of a second, with the real names, dtypes, ragged FP8 blocks and MTP layer.
SMALL = dict(layers=2, dense_layers=1, experts=4, topk=2)


from container_cli import coli, copy_tree  # noqa: E402,F401


@pytest.fixture(scope="session")
def fp8_ckpt(tmp_path_factory) -> Path:
    """The default synthetic FP8 checkpoint (4 layers, 16 experts, 3 shards, MTP layer 4)."""
    d = tmp_path_factory.mktemp("fp8") / "ckpt"
    mk.build_checkpoint(d, seed=5)
    return d


@pytest.fixture(scope="session")
def small_fp8(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("small") / "ckpt"
    mk.build_checkpoint(d, seed=7, **SMALL)
    return d


@pytest.fixture(scope="session")
def f32_ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("f32") / "ckpt"
    mk.build_checkpoint(d, seed=6, weight_dtype="f32", shards=2)
    return d
