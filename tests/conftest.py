"""Shared test setup: `scripts/` and `tests/` importable (oracle builder, checkpoint helpers), the gpu
marker skipped where there is no usable CUDA device, and one-thread torch to keep CI's 2 cores sane."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "scripts", ROOT / "tests", ROOT / "tests" / "runtime"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _compile_the_repository() -> None:
    """Byte-compile the repository's own modules once, before anything imports them. pip compiles what it installs,
    but an editable install leaves the repository's sources as they are, and where PYTHONDONTWRITEBYTECODE is set
    (this development VM; perhaps CI) nothing ever writes their .pyc: each of the suite's ~1,000 Python processes (a
    run's supervisor and three stages, every CLI call) then compiles the ~80 modules it imports from source, ~0.2 s
    of CPU each for a stage (measured: `coli up --detach` 2.2 -> 1.8-2.1 s with them compiled). Importing still only
    reads .pyc (the variable stops writes, not reads); stale ones are recompiled here by mtime, as Python would."""
    if not sys.flags.dont_write_bytecode:
        return                                    # Python writes them itself on first import
    import compileall
    for d in ("coli", "stages", "protocol", "scripts", "tests"):
        compileall.compile_dir(str(ROOT / d), quiet=2, workers=os.cpu_count() or 1)


_compile_the_repository()


def _gpu_available() -> bool:
    try:
        import pycuda.driver as drv  # noqa: F401
        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _gpu_available():
        skip = pytest.mark.skip(reason="needs a CUDA device and PyCUDA (pip install .[gpu])")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ---- the compile tests' nvcc runs, in the background from collection on (tests/nvcc_pool.py says why) ----------
_NVCC_POOL = pytest.StashKey()


def pytest_configure(config):
    config.addinivalue_line("markers", "nvcc(builds=fn): the test's nvcc commands, started right after collection")


def pytest_collection_finish(session):
    from coli.gpu.cubin_build import find_nvcc
    from nvcc_pool import NvccPool

    marked = [m.kwargs["builds"] for item in session.items for m in item.iter_markers("nvcc")]
    if not marked or find_nvcc() is None or session.config.option.collectonly:
        return
    pool = session.config.stash[_NVCC_POOL] = NvccPool()
    for builds in marked:
        pool.submit(builds)


@pytest.fixture(scope="session")
def nvcc_pool(pytestconfig):
    from nvcc_pool import NvccPool

    if _NVCC_POOL not in pytestconfig.stash:
        pytestconfig.stash[_NVCC_POOL] = NvccPool()
    return pytestconfig.stash[_NVCC_POOL]


def pytest_unconfigure(config):
    pool = config.stash.get(_NVCC_POOL, None)
    if pool is not None:
        pool.close()
