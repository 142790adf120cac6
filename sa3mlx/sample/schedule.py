"""Sampling schedules: the log-SNR timestep shift and `build_schedule`, in fp32 as torch does.

Convention: t = 1 is pure noise, t = 0 is data. The SA3 inference default is
`LogSNRShift(rate=0, anchor_logsnr=-6.2, logsnr_end=2.0)`, i.e. t' = sigmoid(8.2·t − 2)
with exact endpoints, independent of the sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sa3mlx.models.fourier import torch_linspace_f32


@dataclass(frozen=True)
class LogSNRShift:
    """t -> sigmoid(−λ), λ = end − t·(end − start), start = anchor_logsnr − rate·log2(L/anchor_length)."""

    anchor_length: float = 2000
    anchor_logsnr: float = -6.2
    rate: float = 1.0
    logsnr_end: float = 2.0

    @classmethod
    def from_dict(cls, d: dict) -> "LogSNRShift":
        if d.get("type", "LogSNRShift") != "LogSNRShift":
            raise ValueError(f"not a LogSNRShift: {d.get('type')}")
        return cls(d.get("anchor_length", 2000), d.get("anchor_logsnr", -6.2), d.get("rate", 1.0),
                   d.get("logsnr_end", 2.0))

    def logsnr_start(self, seq_len):
        """Python float for a scalar length (float64, as torch); fp32 array for an array of lengths."""
        if np.ndim(seq_len) == 0:
            return self.anchor_logsnr - self.rate * math.log2(seq_len / self.anchor_length)
        ratio = np.log2(np.asarray(seq_len, np.float32) / np.float32(self.anchor_length))
        return (np.float32(self.anchor_logsnr) - np.float32(self.rate) * ratio).astype(np.float32)

    def shift(self, t, seq_len) -> np.ndarray:
        """t [N] fp32; seq_len an int, or [K] lengths (K != N gives a [K, N] grid, K == N pairs them)."""
        t = np.asarray(t, np.float32)
        start = self.logsnr_start(seq_len)
        grid_t = t
        if np.ndim(start) == 0:
            span = np.float32(self.logsnr_end - start)
        else:
            if t.ndim == 1 and start.ndim == 1 and t.shape[0] != start.shape[0]:
                grid_t, start = t[None, :], start[:, None]
            span = (np.float32(self.logsnr_end) - start).astype(np.float32)
        logsnr = np.float32(self.logsnr_end) - grid_t * span
        out = _sigmoid_f32(-logsnr)
        out = np.where(t <= 0, np.float32(0), out)  # exact endpoints
        return np.where(t >= 1, np.float32(1), out).astype(np.float32)


def _sigmoid_f32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


SA3_SAMPLING_SHIFT = LogSNRShift(anchor_length=2000, anchor_logsnr=-6.2, rate=0.0, logsnr_end=2.0)


def build_schedule(steps: int, sigma_max: float = 1.0, shift=SA3_SAMPLING_SHIFT, effective_seq_len=None,
                   fallback_seq_len: int | None = None, include_endpoint: bool = True,
                   monotonic: bool = False) -> np.ndarray:
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
