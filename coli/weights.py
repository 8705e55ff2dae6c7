"""Weights from a Hugging Face checkpoint directory (one safetensors file or shards + index).

`HFCheckpoint` memory-maps every shard, checks at open that every tensor the forward needs is
present with the right shape, keeps the MTP layer (layer num_hidden_layers) apart from the forward's tensors
(`mtp_layer` is its index when it is complete, `mtp_problem` says why not otherwise), skips layers beyond it with
one report, and hands tensors out as float32. FP8-e4m3 tensors with a `weight_scale_inv` companion are
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
from coli.model.tensors import (
    MTP_DUPLICATES, dense_shapes, expert_shapes, expert_tensor_name, layer_of, mtp_dense_shapes,
)
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
        self._mtp_where: dict[str, SafetensorsFile] = {}   # the MTP layer's tensors: never read by the forward pass
        skipped: set[int] = set()
        L = self.config.num_hidden_layers
        for f in self._files:
            for name in f.tensors:
                layer = layer_of(name)
                if layer is not None and layer >= L:
                    skipped.add(layer)
                    if layer == L and not name.endswith(MTP_DUPLICATES):
                        self._mtp_where[name] = f
                    continue
                if name in self._where:
                    raise WeightError(f"tensor {name!r} appears in both {self._where[name].path.name} and {f.path.name}")
                self._where[name] = f
        self.skipped_layers = sorted(skipped)
        self._fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in self._where)
        self._check_complete()
        self.mtp_problem: str | None = self._mtp_check() if self._mtp_where else "the checkpoint has no MTP layer"
        self.mtp_layer: int | None = L if self.mtp_problem is None else None
        # a complete MTP layer is what GLM-5 checkpoints carry: nothing to say; anything else is said once
        if skipped and (self.mtp_layer is None or self.skipped_layers != [L]):
            use = "complete (the draft head of --mtp)" if self.mtp_layer is not None else f"not usable: {self.mtp_problem}"
            (report or log.info)(f"skipping tensors of layer(s) {[x for x in self.skipped_layers if x != self.mtp_layer]} "
                                 f"(>= num_hidden_layers {L}: unused by the forward pass); the MTP layer is {use}")

    def _mtp_check(self) -> str | None:
        """None when the MTP layer is complete with the shapes the config implies, else what is wrong (the layer
        is then left out: the main model does not need it)."""
        c, L = self.config, self.config.num_hidden_layers
        want = dict(mtp_dense_shapes(c))
        p = f"model.layers.{L}.mlp.experts."
        if p + "gate_up_proj" in self._mtp_where:
            want[p + "gate_up_proj"] = (c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size)
            want[p + "down_proj"] = (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)
        else:
            for e in range(c.n_routed_experts):
                for part, shape in expert_shapes(c).items():
                    want[expert_tensor_name(L, e, part)] = shape
        for name, shape in want.items():
            f = self._mtp_where.get(name)
            if f is None:
                return f"MTP layer {L} is incomplete: tensor {name!r} is missing"
            if f.tensors[name].shape != tuple(shape):
                return (f"MTP layer {L}: tensor {name!r} has shape {list(f.tensors[name].shape)}, "
                        f"the config needs {list(shape)}")
        return None

    def _file(self, name: str) -> SafetensorsFile:
        f = self._where.get(name) or self._mtp_where.get(name)
        if f is None:
            raise WeightError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return f

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

    def mtp_names(self) -> list[str]:
        """The MTP layer's tensors (empty unless it is complete)."""
        return list(self._mtp_where) if self.mtp_layer is not None else []

    def dtype_of(self, name: str) -> str:
        return self._file(name).tensors[name].dtype

    def file_of(self, name: str) -> Path:
        return self._file(name).path

    def nbytes_of(self, name: str) -> int:
        return self._file(name).tensors[name].nbytes

    def raw(self, name: str) -> np.ndarray:
        return self._file(name).raw(name)

    def tensor_info(self, name: str) -> tuple[Path, TensorInfo]:
        """(shard path, header entry) of a tensor, for readers that stream it themselves (the converter)."""
        f = self._file(name)
        return f.path, f.tensors[name]

    def has(self, name: str) -> bool:
        return name in self._where or name in self._mtp_where

    def dense(self, name: str) -> np.ndarray:
        """float32 tensor; FP8 weights dequantised with their block scales."""
        f = self._file(name)
        w = f.float32(name)
        if f.tensors[name].dtype == "F8_E4M3":
            sname = name + "_scale_inv"
            if not self.has(sname):
                raise WeightError(f"{f.path}: FP8 tensor {name!r} has no {sname!r} companion")
            w = dequant_fp8_blocks(w, self._file(sname).float32(sname), name=name)
        return w

    def expert(self, layer: int, e: int) -> ExpertWeights:
        p = f"model.layers.{layer}.mlp.experts."
        if self.has(p + "gate_up_proj"):
            gu = self._file(p + "gate_up_proj").float32(p + "gate_up_proj")[e]
            Im = self.config.moe_intermediate_size
            return ExpertWeights(gu[:Im], gu[Im:], self._file(p + "down_proj").float32(p + "down_proj")[e])
        g, u, d = (self.dense(expert_tensor_name(layer, e, part)) for part in ("gate_proj", "up_proj", "down_proj"))
        return ExpertWeights(g, u, d)

    def experts(self, layer: int, ids: Iterable[int]) -> dict[int, ExpertWeights]:
        return {int(e): self.expert(layer, int(e)) for e in ids}

    def close(self) -> None:
        for f in self._files:
            f.close()
