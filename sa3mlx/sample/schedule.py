"""Sampling schedules (`build_schedule`), in fp32 as torch builds them.

Convention: t = 1 is pure noise, t = 0 is data. The SA3 inference default shift is
`LogSNRShift(rate=0, anchor_logsnr=-6.2, logsnr_end=2.0)` (`shifts.SA3_SAMPLING_SHIFT`), i.e.
t' = sigmoid(8.2·t − 2) with exact endpoints, independent of the sequence length.
"""

from __future__ import annotations

import numpy as np

from sa3mlx.models.fourier import torch_linspace_f32
from sa3mlx.sample.shifts import SA3_SAMPLING_SHIFT


def build_schedule(
    steps: int,
    sigma_max: float = 1.0,
    shift=SA3_SAMPLING_SHIFT,
    effective_seq_len=None,
    fallback_seq_len: int | None = None,
    include_endpoint: bool = True,
    monotonic: bool = False,
) -> np.ndarray:
    """Timesteps [steps+1] from sigma_max to 0 (or [K, steps+1] for K per-element lengths).

    As torch: shift linspace(sigma_max, 0) and then pin t[..., 0] = sigma_max. For sigma_max < 1
    this is not monotonic (the shifted second value can exceed sigma_max). `monotonic=True`
    instead shifts the normalised grid linspace(1, 0) and scales it by sigma_max.
    """
    n = steps + 1 if include_endpoint else steps
    start = 1.0 if monotonic else sigma_max
    t = torch_linspace_f32(start, 0.0, n) if include_endpoint else torch_linspace_f32(start, 0.0, n + 1)[:-1]
    if shift is None:
        return t * np.float32(sigma_max) if monotonic else t
    seq_len = effective_seq_len if effective_seq_len is not None else fallback_seq_len
    if seq_len is None:
        raise ValueError("build_schedule: a shift needs effective_seq_len or fallback_seq_len")
    seq_len = np.maximum(np.asarray(seq_len, np.float32), 1) if np.ndim(seq_len) else max(int(seq_len), 1)
    t = shift.shift(t, seq_len)
    if monotonic:
        return (t * np.float32(sigma_max)).astype(np.float32)
    t = t.copy()
    t[..., 0] = np.float32(sigma_max)
    return t
