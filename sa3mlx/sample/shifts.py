"""Timestep shifts, in fp32 as torch computes them: one home for the training shifts of a model
config's `distribution_shift_options` (none / full / flux / logsnr) and the log-SNR shift that
builds inference schedules.

Convention: t = 1 is pure noise, t = 0 is data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class LogSNRShift:
    """t -> sigmoid(−λ), λ = end − t·(end − start), start = anchor_logsnr − rate·log2(L/anchor_length)."""

    anchor_length: float = 2000
    anchor_logsnr: float = -6.2
    rate: float = 1.0
    logsnr_end: float = 2.0

    @classmethod
    def from_dict(cls, d: dict) -> LogSNRShift:
        if d.get("type", "LogSNRShift") != "LogSNRShift":
            raise ValueError(f"not a LogSNRShift: {d.get('type')}")
        return cls(
            d.get("anchor_length", 2000), d.get("anchor_logsnr", -6.2), d.get("rate", 1.0), d.get("logsnr_end", 2.0)
        )

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
        out = sigmoid_rounded_exp_f32(-logsnr)
        out = np.where(t <= 0, np.float32(0), out)  # exact endpoints
        return np.where(t >= 1, np.float32(1), out).astype(np.float32)


def sigmoid_f32(x) -> np.ndarray:
    x = np.asarray(x, F32)
    with np.errstate(over="ignore"):
        return (F32(1) / (F32(1) + np.exp(-x))).astype(F32)


def sigmoid_rounded_exp_f32(x) -> np.ndarray:
    """1/(1 + exp(−x)) in fp32 with exp correctly rounded to fp32 (numpy's fp32 exp is not): torch's
    values where numpy's are an ulp off (e.g. t = 0.35 of an init-audio schedule; FIXTURES §generate)."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore"):
        return (F32(1) / (F32(1) + np.exp(-x.astype(np.float64)).astype(F32))).astype(F32)


SA3_SAMPLING_SHIFT = LogSNRShift(anchor_length=2000, anchor_logsnr=-6.2, rate=0.0, logsnr_end=2.0)


class IdentityShift:
    def shift(self, t, seq_len) -> np.ndarray:
        return np.asarray(t, F32).copy()


def _pair_up(t: np.ndarray, per_length: np.ndarray):
    """Official broadcasting: [K] lengths against [N] t with K != N gives a [K, N] grid."""
    if t.ndim == 1 and per_length.ndim == 1 and t.shape[0] != per_length.shape[0]:
        return t[None, :], per_length[:, None]
    return t, per_length


@dataclass(frozen=True)
class FullShift:
    """SA3's `DistributionShift`: t' = S·t / (1 + (S − 1)·t), S = exp(base + (max − base)·frac(L))."""

    base_shift: float = 0.5
    max_shift: float = 1.15
    max_length: float = 4096
    min_length: float = 256
    use_sine: bool = False

    def shift(self, t, seq_len) -> np.ndarray:
        t = np.asarray(t, F32)
        span = self.max_length - self.min_length
        if np.ndim(seq_len) == 0:  # python-number path: mu and exp(mu) in float64
            length = min(max(seq_len, self.min_length), self.max_length)
            exp_mu = F32(
                math.exp(-(self.base_shift + (self.max_shift - self.base_shift) * (length - self.min_length) / span))
            )
        else:
            length = np.clip(np.asarray(seq_len, F32), F32(self.min_length), F32(self.max_length))
            t, length = _pair_up(t, length)
            mu = -(
                F32(self.base_shift)
                + F32(self.max_shift - self.base_shift) * (length - F32(self.min_length)) / F32(span)
            )
            exp_mu = np.exp(mu.astype(F32)).astype(F32)
        with np.errstate(divide="ignore"):
            odds = (F32(1) / (F32(1) - t) - F32(1)).astype(F32)
            out = (F32(1) - exp_mu / (exp_mu + odds)).astype(F32)
        if self.use_sine:
            out = np.sin(out * F32(math.pi / 2)).astype(F32)
        return out


@dataclass(frozen=True)
class FluxShift:
    """SA3's `FluxDistributionShift`: α log-linear in log L between (min, α_min) and (max, α_max)."""

    min_length: float = 256
    max_length: float = 4096
    alpha_min: float = 1.0
    alpha_max: float = 1.0

    def _logs(self):
        log_min, log_max = math.log(self.min_length), math.log(self.max_length)
        if log_max == log_min:
            log_max += 1e-8  # the official guard for a constant alpha
        return (math.log(max(self.alpha_min, 1e-8)), math.log(max(self.alpha_max, 1e-8)), log_min, log_max)

    def alpha(self, seq_len):
        log_a_min, log_a_max, log_min, log_max = self._logs()
        if np.ndim(seq_len) == 0:
            length = max(min(seq_len, self.max_length), self.min_length)
            frac = (math.log(length) - log_min) / (log_max - log_min)
            return math.exp(log_a_min + frac * (log_a_max - log_a_min))
        length = np.clip(np.asarray(seq_len, F32), F32(self.min_length), F32(self.max_length))
        frac = (np.log(length) - F32(log_min)) / F32(log_max - log_min)
        return np.exp(F32(log_a_min) + frac.astype(F32) * F32(log_a_max - log_a_min)).astype(F32)

    def shift(self, t, seq_len) -> np.ndarray:
        t = np.asarray(t, F32)
        alpha = self.alpha(seq_len)
        if np.ndim(seq_len) == 0:
            a, a1 = F32(alpha), F32(alpha - 1.0)
        else:
            t, alpha = _pair_up(t, alpha)
            a, a1 = alpha, (alpha - F32(1)).astype(F32)
        return (a * t / (F32(1) + a1 * t)).astype(F32)


SHIFT_TYPES = ("none", "full", "flux", "logsnr")
_SHIFT_BY_TYPE = {"none": IdentityShift, "full": FullShift, "flux": FluxShift, "logsnr": LogSNRShift}
# official class names (as the schedules fixture names them) -> config type
OFFICIAL_SHIFT_CLASSES = {
    "IdentityDistributionShift": "none",
    "DistributionShift": "full",
    "FluxDistributionShift": "flux",
    "LogSNRShift": "logsnr",
}


def make_shift(options: dict | None):
    """The shift a config's `distribution_shift_options` describe (None: no shift, t unchanged).

    `type` defaults to "full" as upstream; the other keys are the shift's constructor arguments,
    also accepted under an official class name (`DistributionShift`, ...) as the fixtures store them.
    """
    if options is None:
        return None
    options = dict(options)
    kind = options.pop("type", "full")
    kind = OFFICIAL_SHIFT_CLASSES.get(kind, kind)
    if kind not in _SHIFT_BY_TYPE:
        raise ValueError(f"unknown distribution shift type '{kind}'; expected one of {', '.join(SHIFT_TYPES)}")
    cls = _SHIFT_BY_TYPE[kind]
    if kind == "none":
        return cls()
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"distribution shift '{kind}' has no option(s) {unknown}; it takes {sorted(allowed)}")
    return cls(**options)
