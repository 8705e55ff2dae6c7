"""Tolerances for float32 comparisons, derived from the magnitudes involved instead of picked by eye.

Why: two implementations of one float32 function (numpy and torch, two BLAS kernels, numpy and a CUDA
kernel) round differently: summation order, SIMD width, and vectorised libm calls that are a few ulps off
(numpy's AVX-512 float32 `pow` was measured 1.8 ulp off where torch's is 0.75, so the two disagree on RoPE
inverse frequencies by up to 2 ulps on one CPU and agree bit for bit on the next). A fixed `atol=2e-6`
passes on one machine and fails on another; a bound derived from the values holds on all of them.

The analysis is the standard forward-error one (Higham, "Accuracy and Stability of Numerical Algorithms",
§2-3): with unit roundoff u = 2**-24, a float32 result that passed through at most n roundings on any path
from the inputs is within gamma(n) = n*u / (1 - n*u) of the exact value, relative to its *companion*: the
same expression evaluated over the absolute values of the inputs (for a dot product, sum |a_i * b_i|; the
companion is never smaller than the result, and is much larger where terms cancel, which is exactly where
float32 loses digits). Two float32 evaluations are within the sum of their two bounds of each other
(`sides=2`); a float32 one against a float64 evaluation of the formula needs one side.

Non-linear steps are bounded by their slope: an absolute error e in the argument of cos/sin moves the
result by at most e, of silu by at most 1.1 e, of sigmoid by at most e/4; exp turns an absolute error e
into a relative one of about e. A vectorised libm call adds LIBM_ULPS ulps of its own result.

Token-exactness against the oracles is not a tolerance and never goes through this module.
"""

from __future__ import annotations

import numpy as np

U32 = 2.0 ** -24            # float32 unit roundoff: one rounding moves x by at most U32 * |x|
U16 = 2.0 ** -11            # float16 unit roundoff (traces and slices store weights as float16)
LIBM_ULPS = 4               # budget for one float32 pow/exp/cos/sin call of a vectorised libm (SVML, Sleef)
LIBM_REL = LIBM_ULPS * 2.0 ** -23   # the same as a relative error: an ulp is at most 2**-23 of the value


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n: the relative error bound after n roundings in sequence."""
    if n * u >= 1:
        raise ValueError(f"gamma({n}) is undefined: {n} roundings exhaust the precision")
    return n * u / (1 - n * u)


def ulp32(x) -> np.ndarray:
    """The spacing of float32 numbers at |x| (an fp32 angle of 3000 rad has an ulp of 2.4e-4), as float64."""
    return np.spacing(np.abs(np.asarray(x, np.float32))).astype(np.float64)


def rounding_bound(companion, depth: int, sides: int = 1) -> np.ndarray:
    """|fl(f) - f| for a float32 evaluation whose longest path has `depth` roundings, per element.

    `companion` is f evaluated in float64 over |inputs| (e.g. |x| @ |w|.T for x @ w.T). `sides=2` when both
    results being compared are float32 evaluations (each carries its own rounding error)."""
    return sides * gamma(depth) * np.asarray(companion, np.float64)


def matmul_companion(a, b_t) -> np.ndarray:
    """|a| @ |b_t|.T in float64: the companion of the float32 product a @ b_t.T."""
    return np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b_t, np.float64)).T


def swiglu_bound(x, gate, up, down, sides: int = 2) -> np.ndarray:
    """Bound on |Δ| between float32 evaluations of down(silu(x @ gate.T) * (x @ up.T)), per output element.

    x [S, H]; gate/up [Im, H]; down [H, Im] -> [S, H]. Each stage's error is carried forward with the slope
    of the next: silu' <= 1.1, the product adds |Δa||b| + |a||Δb|, the down projection sums |Δm| @ |down|."""
    x64 = np.asarray(x, np.float64)
    H = x64.shape[-1]
    Im = np.asarray(gate).shape[0]
    a = x64 @ np.asarray(gate, np.float64).T                        # [S, Im]
    b = x64 @ np.asarray(up, np.float64).T                          # [S, Im]
    da = rounding_bound(matmul_companion(x64, gate), H)             # each matmul: H roundings deep
    db = rounding_bound(matmul_companion(x64, up), H)
    s = a / (1 + np.exp(-a))                                        # silu in float64
    ds = 1.1 * da + (gamma(3) + LIBM_REL) * np.abs(s)               # slope, then exp + add + divide
    m = s * b
    dm = np.abs(ds) * np.abs(b) + np.abs(s) * db + U32 * np.abs(m)
    d_abs = np.abs(np.asarray(down, np.float64))
    return sides * (dm @ d_abs.T + rounding_bound(np.abs(m) @ d_abs.T, Im))


def assert_within(got, want, bound, what: str) -> None:
    """Assert |got - want| <= bound elementwise; on failure name the worst entry and the share that failed."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), want.shape)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite values in the result"
    diff = np.abs(got - want)
    bad = diff > bound
    if bad.any():
        worst = np.unravel_index(int(np.argmax(np.where(bad, diff / np.maximum(bound, 1e-300), 0))), diff.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} entries exceed the derived bound; worst at {worst}: "
            f"got {got[worst]!r}, want {want[worst]!r}, |Δ| {diff[worst]:.3g} > bound {bound[worst]:.3g}")


REFERENCE_FACTOR = 8        # an engine's float32 forward may be this many times less accurate than the reference's
REFERENCE_FLOOR_ULPS = 16   # ... plus this many ulps of the largest value, should the reference be lucky


def reference_error_bound(reference32, exact) -> float:
    """Bound on max |engine - exact| for a float32 engine that computes what a float32 reference computes.

    A whole model forward is too deep for the per-op analysis above; instead both float32 implementations are
    measured against a float64 run of the same model: the engine must be within REFERENCE_FACTOR of the
    reference's own float32 error (they run the same operations in other orders: absorbed MLA, other
    reductions; on the four oracles here the ratio is 0.9-2.2), plus a floor of REFERENCE_FLOOR_ULPS ulps."""
    exact = np.asarray(exact, np.float64)
    ref_err = float(np.abs(np.asarray(reference32, np.float64) - exact).max())
    return REFERENCE_FACTOR * ref_err + REFERENCE_FLOOR_ULPS * float(ulp32(np.abs(exact).max()))
