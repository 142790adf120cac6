"""Exact duplicates: the same normalised PCM under two names."""

from __future__ import annotations

import hashlib

import numpy as np


def pcm_hash(audio: np.ndarray) -> str:
    """sha256 of the samples as little-endian float32 plus the shape: equal iff the audio is equal."""
    samples = np.ascontiguousarray(audio, dtype="<f4")
    digest = hashlib.sha256(f"{samples.shape}".encode())
    digest.update(samples.data)
    return digest.hexdigest()


class Deduplicator:
    """Remembers the first name seen for each hash; inputs arrive in sorted order, so the
    lexicographically first path is the one kept."""

    def __init__(self):
        self.first: dict[str, str] = {}
        self.duplicates: list[dict[str, str]] = []

    def seen(self, digest: str, name: str) -> str | None:
        """The name kept earlier for this audio, or None (then `name` is kept)."""
        kept = self.first.setdefault(digest, name)
        if kept == name:
            return None
        self.duplicates.append({"kept": kept, "removed": name, "sha256": digest})
        return kept
