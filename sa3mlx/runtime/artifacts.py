"""Readers of the files one stage writes and another reads: a missing or damaged file is an
`ArtifactError` (one line: the file, what is wrong, the fix), never a loader's traceback.

A file listed with a sha256 in the `manifest.json` beside it (a converted model folder) is checked
against it before it is loaded, so a flipped byte is caught too, not only a truncation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from sa3mlx.runtime.errors import ArtifactError, reading
from sa3mlx.runtime.io import sha256_file
from sa3mlx.runtime.layout import MANIFEST_FILE


def read_json(path: str | os.PathLike, what: str = "JSON file", fix: str | None = None) -> dict:
    """A JSON object from `path`."""
    path = Path(path)
    with reading(path, what, fix):
        data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ArtifactError(path, f"damaged {what} (expected a JSON object, found {type(data).__name__})", fix)
    return data


def read_npy(path: str | os.PathLike, what: str = "array", mmap_mode: str | None = "r") -> np.ndarray:
    """A .npy array (memory-mapped by default: the header and the file size are checked now)."""
    path = Path(path)
    with reading(path, what):
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)


def manifest_sha256(path: Path) -> str | None:
    """The sha256 that `manifest.json` beside `path` records for it, if any."""
    manifest = path.parent / MANIFEST_FILE
    if not manifest.is_file():
        return None
    entry = (read_json(manifest, "manifest").get("files") or {}).get(path.name)
    return entry.get("sha256") if isinstance(entry, dict) else None


def verify_listed(path: str | os.PathLike, what: str = "file") -> Path:
    """`path`, checked to exist and to match the sha256 its folder's manifest lists for it."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(path, f"missing ({what})")
    expected = manifest_sha256(path)
    if expected is not None and sha256_file(path) != expected:
        raise ArtifactError(path, f"damaged {what} (its sha256 differs from the one in {MANIFEST_FILE})")
    return path


def load_npz(path: str | os.PathLike, what: str = "weights") -> dict[str, np.ndarray]:
    """Every array of an .npz file (checked against its manifest)."""
    path = verify_listed(path, what)
    with reading(path, what), np.load(path, allow_pickle=False) as arrays:
        return {key: arrays[key] for key in arrays.files}


def load_mlx_arrays(path: str | os.PathLike, what: str = "weights") -> dict:
    """`mx.load` of an .npz or .safetensors file (checked against its manifest)."""
    import mlx.core as mx

    path = verify_listed(path, what)
    with reading(path, what):
        return dict(mx.load(str(path)))
