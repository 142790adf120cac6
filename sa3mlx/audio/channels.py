"""Channel layout: everything becomes stereo."""

from __future__ import annotations

import numpy as np

POLICIES = ("first_two", "downmix")


def reduce_channels(audio: np.ndarray, policy: str = "first_two") -> np.ndarray:
    """(frames, C) -> (frames, min(C, 2)). More than two channels: the first two (like underfit's
    pre-encode), or `downmix`: the mean of all channels on both sides."""
    if policy not in POLICIES:
        raise ValueError(f"channels policy {policy!r}: expected one of {POLICIES}")
    if audio.shape[1] <= 2:
        return audio
    if policy == "first_two":
        return np.ascontiguousarray(audio[:, :2])
    mono = audio.mean(axis=1, dtype=np.float64).astype(np.float32)
    return np.repeat(mono[:, None], 2, axis=1)


def to_stereo(audio: np.ndarray) -> np.ndarray:
    """Mono is duplicated to both sides; stereo is returned as is."""
    if audio.shape[1] == 1:
        return np.repeat(audio, 2, axis=1)
    if audio.shape[1] != 2:
        raise ValueError(f"expected 1 or 2 channels, got {audio.shape[1]} (call reduce_channels first)")
    return audio
