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
    """cpu | numpy: the numpy backend; gpu | cuda: the CUDA backend (PyCUDA + a device, else an error);
    auto: the CUDA backend when PyCUDA imports and a device exists, else numpy."""
    if device in ("cpu", "numpy"):
        return NumpyBackend()
    if device in ("gpu", "cuda", "auto"):
        from coli.model.cuda_runtime import CudaUnavailable
        try:
            from coli.model.cuda_backend import CudaBackend
            return CudaBackend()
        except CudaUnavailable as e:
            if device == "auto":
                return NumpyBackend()
            raise ColiError(f"--device {device}: {e} (use --device cpu)") from None
    raise ColiError(f"device {device!r} is not known (use cpu, gpu or auto)")


def load_model(model_dir: str | Path, device: str = "cpu", report: Callable[[str], None] | None = None
               ) -> tuple[GlmMoeDsaModel, ModelConfig]:
    weights = open_weights(model_dir, report)
    backend = make_backend(device)
    # the GPU keeps every routed expert resident in device memory (this part; a bounded slot pool is next)
    experts = backend.expert_source(weights) if hasattr(backend, "expert_source") else None
    model = GlmMoeDsaModel(weights.config, weights, backend, experts=experts)
    return model, weights.config
