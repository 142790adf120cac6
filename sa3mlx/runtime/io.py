"""Atomic file writes and content hashing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path next to `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give outputs the usual mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write an uncompressed .npz atomically, keys in sorted order (stable bytes)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **{k: arrays[k] for k in sorted(arrays)})


def save_json(path: str | os.PathLike, data) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def remove_stale(out: Path, keep: set[str]) -> None:
    """Delete the files under `out` whose relative POSIX path is not in `keep`, then empty folders."""
    if not out.is_dir():
        return
    for folder, dirs, files in os.walk(out, topdown=False):
        for name in files:
            path = Path(folder, name)
            if path.relative_to(out).as_posix() not in keep:
                path.unlink()
        for name in dirs:
            path = Path(folder, name)
            if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()


def copy_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy a file to `dst` through a temporary name (the same bytes, never a partial file)."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dst)


def plain(value):
    """A JSON-comparable copy: tuples as lists, numpy arrays and scalars as Python values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value
