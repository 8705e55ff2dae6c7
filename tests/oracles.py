"""Oracle models built with transformers inside the test run (scripts/make_oracle.py), cached per
session, and the comparison every end-to-end test makes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ORACLE_CONFIGS = {
    "default": {},
    "shared-indexer": {"indexer_pattern": "FFSS"},
    "groups": {"n_group": 4, "topk_group": 2, "seed": 5},
    "long-prompt": {"prompt_len": 40, "index_topk": 8, "seed": 7},
}

_cache: dict[tuple, Path] = {}


def oracle_dir(tmp_root: Path, name: str, **overrides) -> Path:
    import make_oracle

    opts = {**ORACLE_CONFIGS.get(name, {}), **overrides}
    key = (name, tuple(sorted(opts.items())))
    if key not in _cache:
        out = tmp_root / (name + "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())))
        make_oracle.build_oracle(out, **opts)
        _cache[key] = out
    return _cache[key]


def load_oracle(d: Path) -> dict:
    o = json.loads((d / "oracle.json").read_text())
    o["logits"] = np.load(d / "oracle_logits.npy")
    o["continuation_logits"] = np.load(d / "continuation_logits.npy")
    exact = d / "oracle_logits_f64.npy"       # oracles built before it was added have none
    o["logits_f64"] = np.load(exact) if exact.is_file() else None
    return o


def assert_logits_close(got: np.ndarray, want: np.ndarray, rel: float = 1e-4, exact: np.ndarray | None = None) -> float:
    """`got` against the oracle's float32 logits `want`. With `exact` (the oracle's float64 logits) the bound is
    derived: got must be as close to exact as transformers' float32 is, within tolerances.reference_error_bound.
    Without it (the GPU suite, whose kernels are not held to that yet) a fixed `rel` x scale."""
    if exact is not None:
        from tolerances import reference_error_bound
        bound = reference_error_bound(want, exact)
        err = float(np.abs(np.asarray(got, np.float64) - exact).max())
        assert err <= bound, (f"max logit error {err:.3g} from the float64 oracle exceeds {bound:.3g} "
                              f"(transformers' float32 error {float(np.abs(want - exact).max()):.3g})")
        return err
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    assert diff <= rel * max(scale, 1.0), f"max logit diff {diff:.3g} exceeds {rel} x scale {scale:.3g}"
    return diff
