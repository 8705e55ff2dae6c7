"""Weights from a Hugging Face checkpoint directory (one safetensors file or shards + index).

`HFCheckpoint` memory-maps every shard, checks at open that every tensor the forward needs is
present with the right shape, skips layers >= num_hidden_layers (the MTP layer) with one report,
and hands tensors out as float32. FP8-e4m3 tensors with a `weight_scale_inv` companion are
dequantised by block multiplication (reference §5.2), ragged edge blocks included.

Both weight sources (this and the container reader) implement the same small interface the
model uses: `config`, `dense(name) -> float32 [..]` and `experts(layer, ids) -> {id: ExpertWeights}`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Protocol

import numpy as np

from coli.config import ModelConfig, load_config
from coli.errors import WeightError
from coli.model.tensors import dense_shapes, expert_shapes, expert_tensor_name, layer_of
from coli.safetensors_io import SafetensorsFile, TensorInfo

log = logging.getLogger("coli.weights")

FP8_BLOCK = 128


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert, float32: gate [Im, H], up [Im, H], down [H, Im]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


class WeightSource(Protocol):
    config: ModelConfig

    def dense(self, name: str) -> np.ndarray: ...

    def experts(self, layer: int, ids: Iterable[int]) -> Mapping[int, ExpertWeights]: ...


def dequant_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK, name: str = "") -> np.ndarray:
    """W[r, c] = w[r, c] * scale_inv[r // block, c // block]; the last block row/column may be partial.

    w: float32 [out, in] (already widened from e4m3); scale_inv: float32 [ceil(out/b), ceil(in/b)].
    """
    out, inn = w.shape
    gr, gc = -(-out // block), -(-inn // block)
    if scale_inv.shape != (gr, gc):
        raise WeightError(f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected ({gr}, {gc}) "
                          f"for a [{out}, {inn}] weight in {block}x{block} blocks")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block, axis=0)[:out], block, axis=1)[:, :inn]
    return w * s


def find_shards(model_dir: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The shard files and, for sharded checkpoints, the index's tensor -> shard map."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightError(f"{index}: unreadable or without 'weight_map': {e}") from None
        mapping = {name: model_dir / fname for name, fname in weight_map.items()}
        shards = sorted(set(mapping.values()))
        for s in shards:
            if not s.is_file():
                raise WeightError(f"{index}: names shard {s.name}, which is missing")
        return shards, mapping
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single], None
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found, None
    raise WeightError(f"{model_dir}: no model.safetensors, model.safetensors.index.json or *.safetensors found")


class HFCheckpoint:
    """A Hugging Face glm_moe_dsa checkpoint, memory-mapped."""

    def __init__(self, model_dir: str | Path, config: ModelConfig | None = None,
                 report: Callable[[str], None] | None = None):
        self.dir = Path(model_dir)
        self.config = config or load_config(self.dir)
        shards, _ = find_shards(self.dir)
        self._files = [SafetensorsFile(p) for p in shards]
        self._where: dict[str, SafetensorsFile] = {}
        skipped: set[int] = set()
        L = self.config.num_hidden_layers
        for f in self._files:
            for name in f.tensors:
                layer = layer_of(name)
                if layer is not None and layer >= L:
                    skipped.add(layer)
                    continue
                if name in self._where:
                    raise WeightError(f"tensor {name!r} appears in both {self._where[name].path.name} and {f.path.name}")
                self._where[name] = f
        self.skipped_layers = sorted(skipped)
        if skipped:
            (report or log.info)(f"skipping tensors of layer(s) {self.skipped_layers} "
                                 f"(>= num_hidden_layers {L}: the MTP layer, unused by the forward pass)")
        self._fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in self._where)
        self._check_complete()

    # ---- validation ------------------------------------------------------------------------
    def _shape_of(self, name: str) -> tuple[int, ...]:
        return self._where[name].tensors[name].shape

    def _check_complete(self) -> None:
        c = self.config
        for name, shape in dense_shapes(c).items():
            self._check(name, shape)
        es = expert_shapes(c)
        for layer in c.moe_layers:
            if self._fused_experts:
                p = f"model.layers.{layer}.mlp.experts."
                self._check(p + "gate_up_proj", (c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size))
                self._check(p + "down_proj", (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size))
                continue
            for e in range(c.n_routed_experts):
                for part, shape in es.items():
                    self._check(expert_tensor_name(layer, e, part), shape)

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self._where:
            raise WeightError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        got = self._shape_of(name)
        if got != tuple(shape):
            raise WeightError(f"{self._where[name].path}: tensor {name!r} has shape {list(got)}, "
                              f"the config needs {list(shape)}")

    # ---- access ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._where)

    def dtype_of(self, name: str) -> str:
        return self._where[name].tensors[name].dtype

    def file_of(self, name: str) -> Path:
        return self._where[name].path

    def nbytes_of(self, name: str) -> int:
        return self._where[name].tensors[name].nbytes

    def raw(self, name: str) -> np.ndarray:
        return self._where[name].raw(name)

    def tensor_info(self, name: str) -> tuple[Path, TensorInfo]:
        """(shard path, header entry) of a tensor, for readers that stream it themselves (the converter)."""
        f = self._where[name]
        return f.path, f.tensors[name]

    def dense(self, name: str) -> np.ndarray:
        """float32 tensor; FP8 weights dequantised with their block scales."""
        if name not in self._where:
            raise WeightError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        f = self._where[name]
        w = f.float32(name)
        if f.tensors[name].dtype == "F8_E4M3":
            sname = name + "_scale_inv"
            if sname not in self._where:
                raise WeightError(f"{f.path}: FP8 tensor {name!r} has no {sname!r} companion")
            w = dequant_fp8_blocks(w, self._where[sname].float32(sname), name=name)
        return w

    def expert(self, layer: int, e: int) -> ExpertWeights:
        if self._fused_experts:
            p = f"model.layers.{layer}.mlp.experts."
            gu = self._where[p + "gate_up_proj"].float32(p + "gate_up_proj")[e]
            Im = self.config.moe_intermediate_size
            return ExpertWeights(gu[:Im], gu[Im:], self._where[p + "down_proj"].float32(p + "down_proj")[e])
        g, u, d = (self.dense(expert_tensor_name(layer, e, part)) for part in ("gate_proj", "up_proj", "down_proj"))
        return ExpertWeights(g, u, d)

    def experts(self, layer: int, ids: Iterable[int]) -> dict[int, ExpertWeights]:
        return {int(e): self.expert(layer, int(e)) for e in ids}

    def close(self) -> None:
        for f in self._files:
            f.close()
