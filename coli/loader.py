"""Open a model directory — a Hugging Face checkpoint or a ColiStream container — as a weight source
and build the model on a backend."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from coli.config import ModelConfig, load_config
from coli.errors import ColiError
from coli.model.forward import GlmMoeDsaModel
from coli.model.numpy_backend import NumpyBackend
from coli.weights import HFCheckpoint, WeightSource


def is_container(model_dir: Path) -> bool:
    from coli.container.format import MANIFEST_NAME  # local import: the container package is optional here
    return (model_dir / MANIFEST_NAME).is_file()


def open_weights(model_dir: str | Path, report: Callable[[str], None] | None = None) -> WeightSource:
    d = Path(model_dir)
    if not d.is_dir():
        raise ColiError(f"model directory {d} does not exist")
    try:
        container = is_container(d)
    except ImportError:
        container = False
    if container:
        from coli.container.reader import ContainerReader
        return ContainerReader(d)
    return HFCheckpoint(d, load_config(d), report=report)


def make_backend(device: str = "cpu"):
    if device in ("cpu", "numpy", "auto"):
        return NumpyBackend()
    raise ColiError(f"device {device!r} is not available in this build (use --device cpu)")


def load_model(model_dir: str | Path, device: str = "cpu", report: Callable[[str], None] | None = None
               ) -> tuple[GlmMoeDsaModel, ModelConfig]:
    weights = open_weights(model_dir, report)
    model = GlmMoeDsaModel(weights.config, weights, make_backend(device))
    return model, weights.config
