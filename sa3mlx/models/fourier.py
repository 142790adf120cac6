"""Expo Fourier features of a scalar per sample (DiT timestep, seconds_total).

features = [cos(args), sin(args)], args = ((u·f)·2)·fp32(π) in fp32, with
f = exp(linspace(ln min_freq, ln max_freq, dim/2)). Frequencies reach 1e4, so args
reach ~6e4 rad and a one-ulp change in f moves the output by ~1e-3 relative: the
vector must be torch's fp32 vector bit for bit. For dim 256 (every SA3 model) it is
embedded below; other sizes recompute it the way torch does (not guaranteed bit-exact).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

MIN_FREQ, MAX_FREQ = 0.5, 10000.0

# torch.exp(torch.linspace(0, 1, 128) * (ln 1e4 - ln 0.5) + ln 0.5) in fp32, as IEEE-754 bit patterns
# (copied once from the official code's output; tests check it against both fixture copies).
_TORCH_FREQS_256_BITS = (
    0x3f000000, 0x3f0a6187, 0x3f159a95, 0x3f21bca5, 0x3f2eda9d, 0x3f3d08eb, 0x3f4c5da5, 0x3f5cf0ac,
    0x3f6edbd1, 0x3f811d7d, 0x3f8b962c, 0x3f96e842, 0x3fa32562, 0x3fb0609a, 0x3fbeae8a, 0x3fce2577,
    0x3fdedd75, 0x3ff0f08f, 0x40023d77, 0x400ccd82, 0x401838d7, 0x40249143, 0x4031ea00, 0x404057d7,
    0x404ff140, 0x4060ce88, 0x407309f1, 0x40835ff6, 0x408e078c, 0x40998c5b, 0x40a60051, 0x40b376d3,
    0x40c204d6, 0x40d1c10c, 0x40e2c3ef, 0x40f52806, 0x410484f7, 0x410f4455, 0x411ae2d5, 0x4127728f,
    0x41350718, 0x4143b592, 0x415394e0, 0x4164bdb8, 0x41774ad4, 0x4185ac8c, 0x419083e1, 0x419c3c49,
    0x41a8e80a, 0x41b69ada, 0x41c56a15, 0x41d56cc7, 0x41e6bbe1, 0x41f97261, 0x4206d6b2, 0x4211c633,
    0x421d98bf, 0x422a60c5, 0x42383223, 0x42472264, 0x425748d1, 0x4268be87, 0x427b9ec4, 0x42880370,
    0x42930b55, 0x429ef83f, 0x42abdcc7, 0x42b9ccf6, 0x42c8de88, 0x42d928fb, 0x42eac5a2, 0x42fdcff0,
    0x430932d0, 0x4314534f, 0x43205ad3, 0x432d5c1d, 0x433b6b63, 0x434a9e91, 0x435b0d54, 0x436cd14a,
    0x43800308, 0x438a64cc, 0x43959e1d, 0x43a1c079, 0x43aedebf, 0x43bd0d61, 0x43cc627b, 0x43dcf5eb,
    0x43eee17a, 0x44012090, 0x440b997c, 0x4416ebd5, 0x44232942, 0x443064cb, 0x443eb30e, 0x444e2a56,
    0x445ee2be, 0x4470f644, 0x4482408c, 0x448cd0d7, 0x44983c71, 0x44a49526, 0x44b1ee31, 0x44c05c5d,
    0x44cff62f, 0x44e0d3dc, 0x44f30fb3, 0x45036316, 0x450e0aee, 0x45199000, 0x4526043f, 0x45337b10,
    0x45420965, 0x4551c5f6, 0x4562c95c, 0x45752de0, 0x45848821, 0x458f47bc, 0x459ae680, 0x45a77686,
    0x45b50b5f, 0x45c3ba31, 0x45d399dc, 0x45e4c318, 0x45f750bf, 0x4605afbd, 0x46108752, 0x461c4001,
)
TORCH_FREQS_256 = np.array(_TORCH_FREQS_256_BITS, dtype=np.uint32).view(np.float32)
TORCH_FREQS_256.flags.writeable = False


def torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in fp32: start + i·step on the first half, end − (n−1−i)·step on the second."""
    start32, end32 = np.float32(start), np.float32(end)
    if steps == 1:
        return np.array([start32], np.float32)
    step = (end32 - start32) / np.float32(steps - 1)
    i = np.arange(steps)
    first = start32 + step * i.astype(np.float32)
    second = end32 - step * (steps - 1 - i).astype(np.float32)
    return np.where(i < steps // 2, first, second).astype(np.float32)


def expo_frequencies(dim: int, min_freq: float = MIN_FREQ, max_freq: float = MAX_FREQ) -> np.ndarray:
    """The dim/2 fp32 frequencies of ExpoFourierFeatures(dim, min_freq, max_freq)."""
    if (dim, min_freq, max_freq) == (256, MIN_FREQ, MAX_FREQ):
        return TORCH_FREQS_256.copy()
    log_min, log_max = math.log(min_freq), math.log(max_freq)
    ramp = torch_linspace_f32(0.0, 1.0, dim // 2)
    return np.exp(ramp * np.float32(log_max - log_min) + np.float32(log_min)).astype(np.float32)


def expo_fourier_features(u: mx.array, freqs: mx.array) -> mx.array:
    """[B] values -> [B, 2·len(freqs)] = [cos, sin], in fp32 whatever u's dtype."""
    args = ((u.astype(mx.float32)[:, None] * freqs) * 2.0) * math.pi  # python scalars -> fp32 operands
    return mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1)
