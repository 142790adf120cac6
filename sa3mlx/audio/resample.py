"""Sample-rate conversion with libsoxr."""

from __future__ import annotations

import numpy as np
import soxr

QUALITIES = ("HQ", "VHQ")


def resample(audio: np.ndarray, rate_in: int, rate_out: int, quality: str = "VHQ") -> np.ndarray:
    """(frames, channels) float32 at `rate_in` -> float32 at `rate_out`, soxr's linear-phase
    'HQ' (20-bit) or 'VHQ' (28-bit) filter. Deterministic: the same input gives the same bits."""
    if quality not in QUALITIES:
        raise ValueError(f"resample quality {quality!r}: expected one of {QUALITIES}")
    if rate_in == rate_out:
        return audio
    out = soxr.resample(np.ascontiguousarray(audio, dtype=np.float32), rate_in, rate_out, quality=quality)
    return np.ascontiguousarray(out, dtype=np.float32)
