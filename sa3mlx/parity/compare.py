"""Comparing a recomputed output with its reference: max |delta| and PSNR in dB."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sa3mlx.runtime.io import plain


@dataclass(frozen=True)
class Comparison:
    key: str
    max_abs: float  # nan for exact (non-float) comparisons that differ in shape
    psnr_db: float  # inf when identical; -inf for any exact mismatch
    exact: bool  # compared exactly (bool/int arrays, JSON values)

    def passes(self, threshold_db: float) -> bool:
        return self.psnr_db == math.inf or (not self.exact and self.psnr_db >= threshold_db)


def psnr_db(reference: np.ndarray, result: np.ndarray) -> float:
    """20*log10(max|ref| / RMSE); inf when identical."""
    ref = np.asarray(reference, dtype=np.float64)
    diff = ref - np.asarray(result, dtype=np.float64)
    rmse = math.sqrt(float(np.mean(diff**2))) if diff.size else 0.0
    if rmse == 0.0:
        return math.inf
    peak = float(np.max(np.abs(ref)))
    return 20.0 * math.log10(peak / rmse) if peak > 0 else -math.inf


def compare(key: str, reference, result) -> Comparison:
    if not isinstance(reference, np.ndarray):
        same = plain(reference) == plain(result)
        return Comparison(key, 0.0 if same else math.nan, math.inf if same else -math.inf, True)
    result = np.asarray(result)
    if reference.shape != result.shape:
        return Comparison(key, math.nan, -math.inf, reference.dtype.kind != "f")
    if reference.dtype.kind in "biu" or result.dtype.kind in "b":
        same = bool(np.array_equal(reference, result))
        delta = 0.0 if same else float(np.max(np.abs(reference.astype(np.int64) - result.astype(np.int64))))
        return Comparison(key, delta, math.inf if same else -math.inf, True)
    delta = np.abs(reference.astype(np.float64) - result.astype(np.float64))
    finite = bool(np.all(np.isfinite(result)))
    return Comparison(
        key, float(delta.max()) if delta.size else 0.0, psnr_db(reference, result) if finite else -math.inf, False
    )
