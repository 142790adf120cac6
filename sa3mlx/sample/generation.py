"""The official `StableAudioModel.generate` arithmetic: lengths, masks and schedule of one call.

    N = min(align(ceil_ratio(int((seconds_total + padding_s)·rate))), sample_size)   # audio samples
    T = N // 4096                                                                    # latent frames
    inpaint mask (samples): ones(N); [min(int(a·rate), N) : min(int(b·rate), N)] = 0 per range;
                            [int(seconds_total·rate):] = 0, then latent i takes sample 4096·i
    L = ceil(int(seconds_total·rate) / 4096); padding mask: frame < min(L + int(padding_s·rate/4096), T)
    sigma_max = init_noise_level with init audio, else 1; t = shift(linspace(sigma_max, 0)); t[0] = sigma_max

`align` = 4096·(encoder chunk_size // stride): the latent count is a multiple of the codec's chunk.
Quirks kept on purpose (the official behaviour): the shift is applied to the truncated grid and only
t[0] is reset, so with init audio t[1] > t[0] (the schedule rises before it falls); the inpaint mask
is zero past seconds_total even inside a kept range. `monotonic=True` is the fix, off by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sa3mlx.sample.schedule import build_schedule

DURATION_PADDING_S = 6.0  # official default: latent headroom and attention padding past seconds_total
MAX_SAMPLE_SIZE = 5292032  # official default upper bound in samples (120 s + headroom)


@dataclass(frozen=True)
class Lengths:
    """The sizes one generate call works at."""

    samples: int  # N: audio the latents cover (init/inpaint audio is padded or cut to this)
    latents: int  # T
    effective: int  # L: latent frames of seconds_total (schedule sequence length)
    valid: int  # frames the padding mask keeps (L + headroom, at most T)
    output: int  # samples returned: int(seconds_total·rate)


def lengths(
    seconds: float,
    sample_rate: int,
    samples_per_latent: int,
    latent_align: int,
    padding_s: float = DURATION_PADDING_S,
    sample_size: int = MAX_SAMPLE_SIZE,
) -> Lengths:
    """Every size of one call (`latent_align` = the codec's chunk_size // stride)."""
    target = int((seconds + padding_s) * sample_rate)
    target = -(-target // samples_per_latent) * samples_per_latent
    align = samples_per_latent * latent_align
    samples = min(-(-target // align) * align, sample_size)
    latents = samples // samples_per_latent
    effective = math.ceil(int(seconds * sample_rate) / samples_per_latent)
    headroom = int(padding_s * sample_rate / samples_per_latent)
    return Lengths(samples, latents, effective, min(effective + headroom, latents), int(seconds * sample_rate))


def padding_mask(size: Lengths) -> np.ndarray:
    """[1, T] bool, True for the frames attention treats as real."""
    return (np.arange(size.latents) < size.valid)[None]


def inpaint_mask(ranges: list[tuple[float, float]], seconds: float, size: Lengths, sample_rate: int) -> np.ndarray:
    """[1, 1, T] float32: 1 = keep the given audio, 0 = generate (the ranges, and past seconds_total);
    nearest interpolation to latent resolution: frame i takes sample floor(i·N/T)."""
    mask = np.ones(size.samples, np.float32)
    for start, end in ranges:
        mask[min(int(start * sample_rate), size.samples) : min(int(end * sample_rate), size.samples)] = 0
    mask[min(int(seconds * sample_rate), size.samples) :] = 0
    picks = np.floor(np.arange(size.latents) * (size.samples / size.latents)).astype(np.int64)
    return mask[picks][None, None]


def schedule(steps: int, sigma_max: float, shift, size: Lengths, monotonic: bool = False) -> np.ndarray:
    """[1, steps+1] sigmas as the official build_schedule returns them for one element."""
    return build_schedule(steps, sigma_max, shift=shift, effective_seq_len=[float(size.effective)], monotonic=monotonic)


def fit_audio(audio: np.ndarray, samples: int) -> np.ndarray:
    """[C, n] -> [C, samples]: zero-padded or cut at the end (the official PadCrop, no offset)."""
    if audio.shape[-1] >= samples:
        return audio[..., :samples]
    return np.pad(audio, ((0, 0), (0, samples - audio.shape[-1])))


def finish_audio(decoded: np.ndarray, size: Lengths, samples_per_latent: int) -> np.ndarray:
    """Decoded [B, C, n] -> ·padding mask per sample, fp32, clamp(−1, 1), first int(seconds·rate)."""
    keep = np.repeat(padding_mask(size), samples_per_latent, axis=-1)[:, None, :]
    n = min(decoded.shape[-1], keep.shape[-1])
    audio = decoded[..., :n].astype(np.float32) * keep[..., :n]
    return np.clip(audio, -1.0, 1.0)[..., : size.output]
