"""Gateway tests run a real run (`coli up`: supervisor + stage processes) on the demo model, and a real
`coli serve` on a free loopback port; clients are the official `openai` package, `curl` and raw HTTP.
One run and one gateway are shared by the session (start-up is the expensive part)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Run  # noqa: E402

from gateway_proc import GatewayProc  # noqa: E402,F401


@pytest.fixture(scope="session")
def gw_root():
    d = Path(tempfile.mkdtemp(prefix="coligw-", dir="/tmp"))  # short: ipc:// paths are limited to 107 bytes
    for sub in ("runs", "cache"):
        (d / sub).mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def text_model_dir() -> Path:
    """The built-in demo model: a trained glm_moe_dsa with tokenizer.json and a GLM chat template."""
    from coli.model_store import DEMO_DIR

    if not (DEMO_DIR / "tokenizer.json").is_file():
        pytest.skip("the demo model (coli/demo/model) is not built")
    return DEMO_DIR


@pytest.fixture(scope="session")
def gw_run(gw_root, text_model_dir):
    r = Run(text_model_dir, f"gw{os.getpid() % 10000}", gw_root / "runs", gw_root / "cache", ram_gb=1.0)
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="session")
def gateway(gw_run):
    g = GatewayProc(gw_run)
    yield g
    g.stop()


@pytest.fixture(scope="session")
def run_info(gw_run) -> dict:
    from coli.serve.client import Client

    with Client(gw_run.name, base=gw_run.env["COLI_RUN_DIR"]) as c:
        return dict(c.info)


@pytest.fixture(scope="session")
def tok(run_info):
    from coli.tokenizer import load_tokenizer
    return load_tokenizer(run_info["container"])


@pytest.fixture(scope="session")
def template(run_info):
    from coli.chat_template import load_chat_template
    return load_chat_template(run_info["container"])
