"""Open a model directory — a Hugging Face checkpoint or a ColiStream container — as a weight source
and build the model on a backend."""

from __future__ import annotations

from dataclasses import dataclass
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
        from coli.gpu.cuda_runtime import CudaUnavailable
        try:
            from coli.gpu.cuda_backend import CudaBackend
            return CudaBackend()
        except CudaUnavailable as e:
            if device == "auto":
                return NumpyBackend()
            raise ColiError(f"--device {device}: {e} (use --device cpu)") from None
    raise ColiError(f"device {device!r} is not known (use cpu, gpu or auto)")


@dataclass
class GpuOptions:
    """How the GPU holds routed experts. vram_gb and vram_slots both None: every expert resident."""

    vram_gb: float | None = None          # budget for everything on the device; the rest becomes expert slots
    vram_slots: int | None = None         # or: exactly this many expert slots
    max_context: int = 4096               # KV positions the budget reserves
    policy: str = "freq"                  # VRAM slot replacement policy (coli.gpu.pool)
    tile_kb: int = 1024                   # H2D copy tile

    @property
    def streaming(self) -> bool:
        return self.vram_gb is not None or self.vram_slots is not None


def load_model(model_dir: str | Path, device: str = "cpu", report: Callable[[str], None] | None = None,
               gpu: GpuOptions | None = None) -> tuple[GlmMoeDsaModel, ModelConfig]:
    weights = open_weights(model_dir, report)
    backend = make_backend(device)
    gpu = gpu or GpuOptions()
    if backend.name != "cuda" or not gpu.streaming:
        if gpu.streaming and report is not None and device == "auto":
            report("[no GPU: --vram-gb/--vram-slots ignored, running on the CPU]")
        # the GPU keeps every routed expert resident in device memory unless a budget is given
        experts = backend.expert_source(weights) if hasattr(backend, "expert_source") else None
        model = GlmMoeDsaModel(weights.config, weights, backend, experts=experts)
        return model, weights.config
    if not is_container(Path(model_dir)):
        raise ColiError(f"--vram-gb/--vram-slots stream experts from a ColiStream container; {model_dir} is a "
                        f"checkpoint (convert it with `coli convert`)")
    from coli.gpu.host_records import ContainerHostTier
    from coli.gpu.setup import build_vram_experts
    from coli.stages.faults import Faults
    cfg = weights.config
    model = GlmMoeDsaModel(cfg, weights, backend, experts=_NoExperts())
    faults = Faults.from_env()
    backend.faults = faults if faults.rates else None
    host = ContainerHostTier(weights, n_buffers=max(16, 2 * cfg.num_experts_per_tok))
    vx, plan = build_vram_experts(model, host, cfg, weights.record_layout, vram_gb=gpu.vram_gb, slots=gpu.vram_slots,
                                  max_context=gpu.max_context, policy=gpu.policy, tile_bytes=gpu.tile_kb * 1024,
                                  faults=faults if faults.rates else None)
    if report is not None:
        report(f"[{plan['line']}]")
    return model, cfg


class _NoExperts:
    """Placeholder source while the dense core is uploaded (the VRAM cache is sized after it)."""

    def stream(self, layer, ids):
        raise RuntimeError("the expert source is not set up yet")
