"""Fixtures of the GPU kernel tests: the CUDA backend (module-scoped) and a per-test seeded generator (helpers
are in tests/gpu_helpers.py). Every test in tests/gpu carries the `gpu` marker; tests/conftest.py skips them without a device."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture(scope="module")
def gb():
    from coli.gpu.cuda_backend import CudaBackend
    return CudaBackend()


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
