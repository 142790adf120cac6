"""Writing normalised audio: 32-bit float WAV (lossless) or 24-bit FLAC (quantised).

Both writers put no metadata in the file (no LIST/INFO, ID3, PEAK or Vorbis tags) and
no timestamps, so the same samples always give the same bytes.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import soundfile as sf

from sa3mlx.runtime.io import atomic_path

FORMATS = {"wav": ".wav", "flac": ".flac"}
WAVE_FORMAT_IEEE_FLOAT = 3
INT24_MAX = 8388607


def write_audio(path: str | os.PathLike, audio: np.ndarray, rate: int, fmt: str) -> int:
    """Write (frames, channels) float32 atomically; returns the number of clipped samples
    (always 0 for WAV, which keeps values beyond ±1)."""
    if fmt == "wav":
        write_float_wav(path, audio, rate)
        return 0
    if fmt == "flac":
        return write_flac24(path, audio, rate)
    raise ValueError(f"output format {fmt!r}: expected one of {sorted(FORMATS)}")


def write_float_wav(path: str | os.PathLike, audio: np.ndarray, rate: int) -> None:
    """RIFF/WAVE, IEEE float 32-bit: a `fmt ` chunk (18 bytes), a `fact` chunk and `data`."""
    samples = np.ascontiguousarray(audio, dtype="<f4")
    frames, channels = samples.shape
    data_bytes = samples.nbytes
    fmt = struct.pack("<HHIIHHH", WAVE_FORMAT_IEEE_FLOAT, channels, rate, rate * channels * 4, channels * 4, 32, 0)
    fact = struct.pack("<I", frames)
    riff_size = 4 + (8 + len(fmt)) + (8 + len(fact)) + (8 + data_bytes)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", riff_size) + b"WAVE")
        f.write(b"fmt " + struct.pack("<I", len(fmt)) + fmt)
        f.write(b"fact" + struct.pack("<I", len(fact)) + fact)
        f.write(b"data" + struct.pack("<I", data_bytes))
        f.write(samples.data)


def write_flac24(path: str | os.PathLike, audio: np.ndarray, rate: int) -> int:
    """24-bit FLAC: samples are rounded to 1/8388607 steps and clipped to [-1, 1)."""
    scaled = np.round(audio.astype(np.float64) * INT24_MAX)
    clipped = int(np.count_nonzero((scaled > INT24_MAX) | (scaled < -INT24_MAX - 1)))
    ints = np.clip(scaled, -INT24_MAX - 1, INT24_MAX).astype(np.int32) << 8  # libsndfile keeps the top 24 bits
    with atomic_path(path) as tmp:
        sf.write(tmp, ints, rate, format="FLAC", subtype="PCM_24")
    return clipped
