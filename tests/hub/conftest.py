"""Fixtures of the hub tests: a Hub on 127.0.0.1 (hub_server.py) serving synthetic checkpoints in the GLM-5-FP8
layout (scripts/make_fp8_checkpoint.py), and `coli` run as a subprocess with HF_ENDPOINT pointed at it."""

from __future__ import annotations

import os
import subprocess
import sys
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


def hub_env(url: str, home: Path, token: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=url, HF_HOME=str(home / "hf-home"), HF_HUB_CACHE=str(home / "hf-cache"),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", COLI_CACHE=str(home / "coli-cache"),
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    if token:
        env["HF_TOKEN"] = token
    return env


def coli(env: dict, *args, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


@pytest.fixture
def hub(small_ckpt):
    with HubServer({"org/tiny": repo_from_dir(small_ckpt)}) as s:
        yield s
