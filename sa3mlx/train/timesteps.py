"""Training timesteps: the five samplers and the training distribution shifts, in fp32 as torch.

Convention: t = 1 is pure noise, t = 0 is data. Each sampler is a pure function of the random
draws it transforms (`z` standard normal, `u` uniform in [0, 1)), so stored draws can be fed;
`sample_timesteps` draws them from a seeded numpy Generator. Shifts follow the model config's
`distribution_shift_options` (`type` none / full / flux / logsnr, default full); the shift's
sequence length is per sample from the full-song `seconds_total` when the model config says
`use_effective_length_for_schedule`, else the crop length.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from sa3mlx.sample.shifts import sigmoid_f32

F32 = np.float32
SAMPLERS = ("uniform", "logit_normal", "trunc_logit_normal", "log_snr", "log_snr_uniform")
NORMAL_DRAW_SAMPLERS = ("logit_normal", "trunc_logit_normal", "log_snr")
LOGSNR_CLAMP_EPS = 1e-4  # official clamp of the log-SNR samplers' t


# ---- samplers: pure transforms of supplied draws ---------------------------------------------


def uniform_t(u) -> np.ndarray:
    return np.asarray(u, F32).copy()


def logit_normal_t(z) -> np.ndarray:
    return sigmoid_f32(z)


def _normal_cdf_f32(x) -> np.ndarray:
    values = np.asarray(x, np.float64).ravel()
    out = [0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in values]
    return np.asarray(out, np.float64).reshape(np.shape(x)).astype(F32)


def _normal_icdf_f32(p) -> np.ndarray:
    """torch Normal(0,1).icdf in fp32: erfinv(2p − 1)·√2, the 2p − 1 rounded to fp32 first."""
    y = (F32(2) * np.asarray(p, F32) - F32(1)).astype(F32)
    unit = NormalDist()

    def erfinv(v: float) -> float:
        if v >= 1.0:
            return math.inf
        if v <= -1.0:
            return -math.inf
        return unit.inv_cdf((v + 1.0) / 2.0) / math.sqrt(2.0)

    inv = np.asarray([erfinv(float(v)) for v in y.ravel()], np.float64).reshape(y.shape).astype(F32)
    return (inv * F32(math.sqrt(2.0))).astype(F32)


def trunc_logit_normal_raw(z, left_trunc: float = 0.075, right_trunc: float = 1.0) -> np.ndarray:
    """The official `truncated_logistic_normal_rescaled` of draws z: values in [0, 1)."""

    def bound(p: float) -> F32:
        logit = math.inf if p >= 1 else -math.inf if p <= 0 else math.log(p / (1 - p))
        return _normal_cdf_f32(np.float32(logit))[()]

    lower, upper = bound(F32(left_trunc)), bound(F32(right_trunc))
    cdf = lower + (upper - lower) * _normal_cdf_f32(z)
    samples = sigmoid_f32(_normal_icdf_f32(cdf.astype(F32)))
    return ((samples - F32(left_trunc)) / F32(right_trunc - left_trunc)).astype(F32)


def trunc_logit_normal_t(z, left_trunc: float = 0.075, right_trunc: float = 1.0) -> np.ndarray:
    """Training flips the truncated sampler: t = 1 − raw, in (0, 1]."""
    return (F32(1) - trunc_logit_normal_raw(z, left_trunc, right_trunc)).astype(F32)


def _clamp_t(t: np.ndarray, eps: float) -> np.ndarray:
    return np.clip(t, F32(eps), F32(1 - eps)).astype(F32)


def log_snr_t(z, mean_logsnr: float = -1.2, std_logsnr: float = 2.0, clamp_eps: float = LOGSNR_CLAMP_EPS) -> np.ndarray:
    logsnr = (np.asarray(z, F32) * F32(std_logsnr) + F32(mean_logsnr)).astype(F32)
    return _clamp_t(sigmoid_f32(-logsnr), clamp_eps)


def log_snr_uniform_t(
    u, min_logsnr: float = -6.0, max_logsnr: float = 5.0, clamp_eps: float = LOGSNR_CLAMP_EPS
) -> np.ndarray:
    logsnr = (np.asarray(u, F32) * F32(max_logsnr - min_logsnr) + F32(min_logsnr)).astype(F32)
    return _clamp_t(sigmoid_f32(-logsnr), clamp_eps)


TRANSFORMS = {
    "uniform": uniform_t,
    "logit_normal": logit_normal_t,
    "trunc_logit_normal": trunc_logit_normal_t,
    "log_snr": log_snr_t,
    "log_snr_uniform": log_snr_uniform_t,
}
# the `timestep_sampler_options` each sampler accepts (the official names)
SAMPLER_OPTIONS = {
    "uniform": (),
    "logit_normal": (),
    "trunc_logit_normal": ("left_trunc", "right_trunc"),
    "log_snr": ("mean_logsnr", "std_logsnr"),
    "log_snr_uniform": ("min_logsnr", "max_logsnr"),
}


def check_sampler(name: str, options: dict | None = None) -> None:
    if name not in SAMPLERS:
        raise ValueError(f"unknown timestep sampler '{name}'; expected one of {', '.join(SAMPLERS)}")
    unknown = sorted(set(options or {}) - set(SAMPLER_OPTIONS[name]))
    if unknown:
        raise ValueError(
            f"timestep sampler '{name}' has no option(s) {unknown}; it takes {list(SAMPLER_OPTIONS[name]) or 'none'}"
        )


def draw_for(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """The fp32 draws the named sampler transforms: N(0, 1) or U[0, 1)."""
    if name in NORMAL_DRAW_SAMPLERS:
        return rng.standard_normal(n, dtype=F32)
    return rng.random(n, dtype=F32)


def transform_draws(name: str, draws, options: dict | None = None) -> np.ndarray:
    check_sampler(name, options)
    return TRANSFORMS[name](draws, **(options or {}))


def sample_timesteps(name: str, n: int, rng: np.random.Generator, options: dict | None = None) -> np.ndarray:
    """n training timesteps [n] fp32 from the named sampler, drawn from `rng`."""
    check_sampler(name, options)
    return transform_draws(name, draw_for(name, n, rng), options)


# ---- sequence lengths --------------------------------------------------------------------------


def effective_seq_len(seconds_total, sample_rate: int = 44100, downsampling_ratio: int = 4096) -> np.ndarray:
    """Per-sample latent length of the full song: ceil(int(seconds·sample_rate) / ratio), fp32."""
    lengths = [math.ceil(int(float(s) * sample_rate) / downsampling_ratio) for s in np.ravel(seconds_total)]
    return np.asarray(lengths, F32)


def schedule_seq_len(
    seconds_total,
    crop_length: int,
    use_effective_length: bool,
    sample_rate: int = 44100,
    downsampling_ratio: int = 4096,
):
    """What the shift is given: per-sample effective lengths, or the crop length as a python int
    when the config does not ask for effective lengths or a sample lacks seconds_total."""
    if use_effective_length and seconds_total is not None and not np.any(np.isnan(np.asarray(seconds_total, float))):
        return effective_seq_len(seconds_total, sample_rate, downsampling_ratio)
    return int(crop_length)


def shift_timesteps(t, shift, seq_len) -> np.ndarray:
    """t shifted by the training shift (None: unchanged), fp32 [B]."""
    t = np.asarray(t, F32)
    return t.copy() if shift is None else np.asarray(shift.shift(t, seq_len), F32)


# ---- log-SNR conditioning value ----------------------------------------------------------------


def t_to_logsnr_cond(t, logsnr_min: float = -12.0, logsnr_max: float = 5.0, t_clamp_eps: float = 1e-7) -> np.ndarray:
    """SA3's `_t_to_logsnr_cond`: (max − clamp(log((1−t)/t), min, max)) / (max − min), fp32."""
    t = np.clip(np.asarray(t, F32), F32(t_clamp_eps), F32(1 - t_clamp_eps)).astype(F32)
    logsnr = np.log(((F32(1) - t) / t).astype(F32)).astype(F32)
    logsnr = np.clip(logsnr, F32(logsnr_min), F32(logsnr_max))
    return ((F32(logsnr_max) - logsnr) / F32(logsnr_max - logsnr_min)).astype(F32)
