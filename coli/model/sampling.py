"""Token selection from logits: greedy (first maximum, like torch/np argmax) or seeded sampling with
temperature, top-k and top-p, applied in the order transformers applies them (temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0 = off
    seed: int | None = None

    def validate(self) -> None:
        if not self.greedy:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling (got {self.temperature}); use greedy instead")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0 (got {self.top_k})")


@dataclass
class Sampler:
    params: SamplingParams
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.params.validate()
        self.rng = np.random.default_rng(self.params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits [V] float32 -> token id."""
        if self.params.greedy:
            return int(np.argmax(logits))
        return self.draw(self.distribution(logits))

    def draw(self, probs: np.ndarray) -> int:
        """A token from a distribution [V] float64 (summing to 1), with this sampler's generator."""
        return int(self.rng.choice(probs.shape[0], p=probs))

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The distribution [V] float64 a sampled token is drawn from: temperature, then top-k, then top-p
        (speculative sampling compares the target's and the draft's, coli.model.mtp)."""
        p = self.params
        z = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < z.shape[0]:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            cut = int(np.searchsorted(cum, p.top_p)) + 1
            keep = order[:cut]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return probs
