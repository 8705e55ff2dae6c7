"""Fixtures of the hub tests: a Hub on 127.0.0.1 (hub_server.py) serving synthetic checkpoints in the GLM-5-FP8
layout (scripts/make_fp8_checkpoint.py), and `coli` run as a subprocess with HF_ENDPOINT pointed at it."""

from __future__ import annotations

from pathlib import Path

import pytest

import make_fp8_checkpoint as mk
from hub_server import HubServer, repo_from_dir

SMALL = dict(layers=2, dense_layers=1, experts=4, topk=2)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hub-small") / "ckpt"
    mk.build_checkpoint(d, seed=7, **SMALL)
    return d


@pytest.fixture(scope="session")
def big_ckpt(tmp_path_factory) -> Path:
    # ~50 MB of FP8 input in 5 shards, expert records spanning shard boundaries
    d = tmp_path_factory.mktemp("hub-big") / "ckpt"
    mk.build_checkpoint(d, seed=3, experts=80, random_codes=True, tokenizer=False, shards=5)
    return d


@pytest.fixture
def hub(small_ckpt):
    with HubServer({"org/tiny": repo_from_dir(small_ckpt)}) as s:
        yield s
