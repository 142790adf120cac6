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
    0x3F000000,
    0x3F0A6187,
    0x3F159A95,
    0x3F21BCA5,
    0x3F2EDA9D,
    0x3F3D08EB,
    0x3F4C5DA5,
    0x3F5CF0AC,
    0x3F6EDBD1,
    0x3F811D7D,
    0x3F8B962C,
    0x3F96E842,
    0x3FA32562,
    0x3FB0609A,
    0x3FBEAE8A,
    0x3FCE2577,
    0x3FDEDD75,
    0x3FF0F08F,
    0x40023D77,
    0x400CCD82,
    0x401838D7,
    0x40249143,
    0x4031EA00,
    0x404057D7,
    0x404FF140,
    0x4060CE88,
    0x407309F1,
    0x40835FF6,
    0x408E078C,
    0x40998C5B,
    0x40A60051,
    0x40B376D3,
    0x40C204D6,
    0x40D1C10C,
    0x40E2C3EF,
    0x40F52806,
    0x410484F7,
    0x410F4455,
    0x411AE2D5,
    0x4127728F,
    0x41350718,
    0x4143B592,
    0x415394E0,
    0x4164BDB8,
    0x41774AD4,
    0x4185AC8C,
    0x419083E1,
    0x419C3C49,
    0x41A8E80A,
    0x41B69ADA,
    0x41C56A15,
    0x41D56CC7,
    0x41E6BBE1,
    0x41F97261,
    0x4206D6B2,
    0x4211C633,
    0x421D98BF,
    0x422A60C5,
    0x42383223,
    0x42472264,
    0x425748D1,
    0x4268BE87,
    0x427B9EC4,
    0x42880370,
    0x42930B55,
    0x429EF83F,
    0x42ABDCC7,
    0x42B9CCF6,
    0x42C8DE88,
    0x42D928FB,
    0x42EAC5A2,
    0x42FDCFF0,
    0x430932D0,
    0x4314534F,
    0x43205AD3,
    0x432D5C1D,
    0x433B6B63,
    0x434A9E91,
    0x435B0D54,
    0x436CD14A,
    0x43800308,
    0x438A64CC,
    0x43959E1D,
    0x43A1C079,
    0x43AEDEBF,
    0x43BD0D61,
    0x43CC627B,
    0x43DCF5EB,
    0x43EEE17A,
    0x44012090,
    0x440B997C,
    0x4416EBD5,
    0x44232942,
    0x443064CB,
    0x443EB30E,
    0x444E2A56,
    0x445EE2BE,
    0x4470F644,
    0x4482408C,
    0x448CD0D7,
    0x44983C71,
    0x44A49526,
    0x44B1EE31,
    0x44C05C5D,
    0x44CFF62F,
    0x44E0D3DC,
    0x44F30FB3,
    0x45036316,
    0x450E0AEE,
    0x45199000,
    0x4526043F,
    0x45337B10,
    0x45420965,
    0x4551C5F6,
    0x4562C95C,
    0x45752DE0,
    0x45848821,
    0x458F47BC,
    0x459AE680,
    0x45A77686,
    0x45B50B5F,
    0x45C3BA31,
    0x45D399DC,
    0x45E4C318,
    0x45F750BF,
    0x4605AFBD,
    0x46108752,
    0x461C4001,
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
