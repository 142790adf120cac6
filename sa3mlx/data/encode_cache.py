"""The content-addressed latent cache behind the `encode` stage.

An entry is keyed by sha256 of (normalised audio bytes hash, codec fingerprint, encode
params), so a renamed or re-normalised identical file hits, and any change to the codec or
the params misses everywhere. Each entry is two files under `<root>/<key[:2]>/`: the latents
`<key>.npy` ([latent_dim, T] float32) and `<key>.json` (mask, sample count, what was hashed).
Both are written atomically, the npy first: the json is the commit mark, so an entry is
either complete or absent, whatever kills the process.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sa3mlx.runtime.io import atomic_path, save_json

TMP_SUFFIX = ".tmp"  # what `atomic_path` leaves behind only when the process is killed


def entry_key(audio_sha256: str, codec_sha256: str, params: dict) -> str:
    text = json.dumps({"audio": audio_sha256, "codec": codec_sha256, "params": params}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    latents: Path  # the cached .npy
    latent_shape: list[int]  # [latent_dim, T]
    mask: list[int]  # 0/1 per latent
    audio_samples: int


class LatentCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def ignore_in_git(self) -> None:
        """A `*` .gitignore inside: DVC gitignores only cached outputs, and this one is `cache: false`."""
        marker = self.root / ".gitignore"
        if not marker.is_file():
            self.root.mkdir(parents=True, exist_ok=True)
            marker.write_text('# the encode stage\'s machine-local latent cache (see README "encode")\n*\n')

    def _paths(self, key: str) -> tuple[Path, Path]:
        folder = self.root / key[:2]
        return folder / f"{key}.npy", folder / f"{key}.json"

    def get(self, key: str) -> Entry | None:
        npy, meta = self._paths(key)
        if not (meta.is_file() and npy.is_file()):
            return None
        try:
            info = json.loads(meta.read_text())
            return Entry(npy, list(info["latent_shape"]), list(info["padding_mask"]), int(info["audio_samples"]))
        except (ValueError, KeyError, TypeError):  # a hand-edited or foreign file: encode again
            return None

    def put(self, key: str, latents: np.ndarray, mask: np.ndarray, audio_samples: int, about: dict) -> Entry:
        npy, meta = self._paths(key)
        with atomic_path(npy) as tmp, open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(latents, dtype=np.float32))
        padding = [int(v) for v in mask]
        save_json(
            meta,
            {
                **about,
                "padding_mask": padding,
                "audio_samples": int(audio_samples),
                "latent_shape": list(latents.shape),
            },
        )
        return Entry(npy, list(latents.shape), padding, int(audio_samples))

    def remove_leftovers(self) -> int:
        """Delete temporary files a killed run left behind; returns how many."""
        return remove_temporaries(self.root)


def remove_temporaries(root: str | os.PathLike) -> int:
    """Delete `.<name>.<random>.tmp` files (from `atomic_path`) under `root`."""
    removed = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.startswith(".") and name.endswith(TMP_SUFFIX):
                Path(folder, name).unlink(missing_ok=True)
                removed += 1
    return removed
