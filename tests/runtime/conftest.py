import itertools
import os
from pathlib import Path

import pytest

from harness import Run
from oracles import oracle_dir

_names = itertools.count()


@pytest.fixture(scope="session")
def rt_root(tmp_path_factory):
    # ipc:// paths must stay under 107 bytes: keep the run dir short
    import tempfile
    import shutil
    d = Path(tempfile.mkdtemp(prefix="colirt-", dir="/tmp"))
    (d / "runs").mkdir()
    (d / "cache").mkdir()
    yield d
    # every run was stopped by its test's start_run teardown: the converted caches (~60 MB a session) go too,
    # instead of piling up in /tmp session after session
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def oracle_root(tmp_path_factory):
    return tmp_path_factory.mktemp("rt-oracles")


@pytest.fixture(scope="session")
def default_oracle(oracle_root):
    return oracle_dir(oracle_root, "default")


@pytest.fixture
def start_run(rt_root):
    runs = []

    def start(model, ram_gb=1.0, extra_env=None, wait=True, args=()):
        r = Run(model, f"t{os.getpid() % 1000}-{next(_names)}", rt_root / "runs", rt_root / "cache", ram_gb,
                extra_env, args)
        runs.append(r)
        if wait:
            r.wait_ready()
        return r

    yield start
    for r in runs:
        r.stop()
