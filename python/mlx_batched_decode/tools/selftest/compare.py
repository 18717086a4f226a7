"""An op's output against the float32 reference: the worst absolute error and its tolerance."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# Max abs error against the float32 reference on the same (upcast) inputs, per output dtype:
# the output is rounded to its dtype (|out| < ~3 for unit-normal values); float32 leaves only
# the order of summation (the GPU tests' bound; the CPU kernel stays below 1e-5).
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}


@dataclass(frozen=True)
class Comparison:
    """``error``: the largest |out - expected| (inf for a wrong shape or a non-finite value)."""

    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def worst_error(out: mx.array, expected: mx.array) -> float:
    """Max |out - expected| in float32. The self-test's references are finite everywhere
    (rows with no key are zeros), so NaN or inf on either side counts as an infinite error."""
    if out.shape != expected.shape:
        return float("inf")
    diff = mx.abs(out.astype(mx.float32) - expected.astype(mx.float32))
    diff = mx.where(mx.isfinite(diff), diff, mx.array(float("inf")))
    return mx.max(diff).item() if diff.size else 0.0


def compare(out: mx.array, expected: mx.array, dtype: mx.Dtype) -> Comparison:
    """``out`` (computed in ``dtype``) against ``expected`` with ``dtype``'s tolerance."""
    return Comparison(worst_error(out, expected), TOLERANCE[dtype])
