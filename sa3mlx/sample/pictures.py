"""Mel spectrogram pictures of demo audio: numpy STFT, a Slaney-style mel filterbank, dB scale,
a perceptually ordered colour map, PNG through Pillow (low frequencies at the bottom)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sa3mlx.runtime.io import atomic_path

N_FFT = 2048
HOP = 512
N_MELS = 128
TOP_DB = 80.0  # dynamic range shown below the loudest bin
PIXELS_PER_MEL = 2
MAX_WIDTH = 1200  # columns; longer clips are averaged down to this
# anchor colours of an inferno-like map, dark (quiet) to bright (loud)
_ANCHORS = np.array(
    [
        [0, 0, 4],
        [40, 11, 84],
        [101, 21, 110],
        [159, 42, 99],
        [212, 72, 66],
        [245, 125, 21],
        [250, 193, 39],
        [252, 255, 164],
    ],
    np.float64,
)


def hz_to_mel(hz):
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, np.float64)
    linear = hz / (200.0 / 3)
    log = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log, linear)


def mel_to_hz(mel):
    mel = np.asarray(mel, np.float64)
    linear = mel * (200.0 / 3)
    log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log, linear)


def mel_filterbank(sample_rate: int, n_fft: int = N_FFT, n_mels: int = N_MELS) -> np.ndarray:
    """[n_mels, n_fft//2 + 1] triangular filters, area-normalised (Slaney)."""
    bins = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None] - lower) / (centre - lower)
    falling = (upper - bins[None]) / (upper - centre)
    weights = np.maximum(0.0, np.minimum(rising, falling))
    return weights * (2.0 / (upper - lower))


def stft_power(mono: np.ndarray, n_fft: int = N_FFT, hop: int = HOP) -> np.ndarray:
    """|STFT|² [n_fft//2 + 1, frames] of a centred, reflect-padded Hann-windowed signal."""
    mono = np.asarray(mono, np.float64)
    if mono.size < 2:
        mono = np.zeros(2)
    pad = min(n_fft // 2, mono.size - 1)
    padded = np.pad(mono, pad, mode="reflect")
    if padded.size < n_fft:
        padded = np.pad(padded, (0, n_fft - padded.size))
    frames = 1 + (padded.size - n_fft) // hop
    index = np.arange(n_fft)[None, :] + hop * np.arange(frames)[:, None]
    window = np.hanning(n_fft + 1)[:-1]
    return (np.abs(np.fft.rfft(padded[index] * window, axis=1)) ** 2).T


def mel_db(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """[C, S] (or [S]) audio -> [n_mels, frames] dB, top at 0 dB, floored at −TOP_DB."""
    mono = np.asarray(audio, np.float64)
    mono = mono.mean(axis=0) if mono.ndim == 2 else mono
    mel = mel_filterbank(sample_rate) @ stft_power(mono)
    db = 10.0 * np.log10(np.maximum(mel, 1e-10))
    return np.maximum(db - db.max(), -TOP_DB)


def colorize(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> uint8 RGB through the anchor colour map."""
    position = np.clip(values, 0.0, 1.0) * (len(_ANCHORS) - 1)
    low = np.minimum(position.astype(int), len(_ANCHORS) - 2)
    frac = (position - low)[..., None]
    return np.round(_ANCHORS[low] * (1 - frac) + _ANCHORS[low + 1] * frac).astype(np.uint8)


def shrink_columns(image: np.ndarray, width: int) -> np.ndarray:
    """Average groups of columns so that at most `width` remain."""
    columns = image.shape[1]
    if columns <= width:
        return image
    edges = np.linspace(0, columns, width + 1).astype(int)
    return np.stack([image[:, a:b].mean(axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)


def spectrogram_rgb(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """[height, width, 3] uint8 picture: time left to right, low mels at the bottom."""
    db = shrink_columns(mel_db(audio, sample_rate), MAX_WIDTH)
    rgb = colorize(1.0 + db / TOP_DB)[::-1]
    return np.repeat(rgb, PIXELS_PER_MEL, axis=0)


def write_spectrogram(path: str | Path, audio: np.ndarray, sample_rate: int) -> Path:
    """Write the mel spectrogram of [C, S] audio as a PNG, atomically."""
    from PIL import Image

    path = Path(path)
    image = Image.fromarray(spectrogram_rgb(audio, sample_rate))
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG")
    return path
