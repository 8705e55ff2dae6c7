"""Fixtures for the bench tests: tiny-dims slices (the `tiny` preset), written in a few milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from slice_helpers import write_tiny


@pytest.fixture(scope="session")
def tiny_slice(tmp_path_factory) -> Path:
    """One MoE layer of the tiny model, int4 g64 experts, bf16 dense core (named: make-slice's default is int8 now),
    glm52 routing of 256 tokens."""
    return write_tiny(tmp_path_factory.mktemp("slice") / "s1", dense_fmt="bf16")


@pytest.fixture(scope="session")
def tiny_slice3(tmp_path_factory) -> Path:
    """Three MoE layers, uniform routing of 40 tokens (short, so replays wrap around)."""
    return write_tiny(tmp_path_factory.mktemp("slice") / "s3", layers=3, trace="uniform", tokens=40, seed=3)


@pytest.fixture()
def nogpu(monkeypatch):
    """No CUDA device, whatever the machine has: a CLI test shows its refusal comes before the GPU check."""
    from coli.gpu import cuda_runtime

    def nogpu(device=0):
        raise cuda_runtime.CudaUnavailable("no CUDA device (test)")
    monkeypatch.setattr(cuda_runtime, "get_runtime", nogpu)
