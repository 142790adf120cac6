"""Listing a dataset folder: audio-named entries in sorted order, plus what is skipped and why."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

AUDIO_EXTENSIONS = frozenset(
    {
        ".wav",
        ".wave",
        ".flac",
        ".ogg",
        ".oga",
        ".opus",
        ".mp3",
        ".aif",
        ".aiff",
        ".aifc",
        ".caf",
        ".w64",
        ".au",
        # containers libsndfile cannot decode: listed so that they are reported, not silently skipped
        ".m4a",
        ".aac",
        ".mp4",
        ".wma",
        ".ape",
        ".wv",
    }
)
SIDECAR_EXTENSIONS = frozenset({".json", ".txt"})


@dataclass
class Listing:
    inputs: list[str] = field(default_factory=list)  # POSIX paths relative to the root, sorted
    bad_names: list[dict] = field(default_factory=list)  # non-UTF-8 paths: {"path" (\x escapes), "suggested"}
    ignored: list[dict] = field(default_factory=list)  # {"path", "why"}


def scan(root: str | os.PathLike) -> Listing:
    """Walk `root` (sorted, symlinked folders not followed, hidden entries skipped)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder")
    listing = Listing()
    _walk(root, "", listing)
    return listing


def _walk(folder: Path, prefix: str, listing: Listing) -> None:
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        rel = prefix + entry.name
        if not _is_utf8(entry.name):
            raw = os.fsencode(rel)
            listing.bad_names.append({"path": raw.decode("utf-8", "backslashreplace"), "suggested": _guess_text(raw)})
            continue
        if entry.name.startswith("."):
            listing.ignored.append({"path": rel, "why": "hidden"})
            continue
        is_audio = Path(entry.name).suffix.lower() in AUDIO_EXTENSIONS
        if entry.is_dir(follow_symlinks=False):
            if is_audio:
                listing.inputs.append(rel)  # quarantined as a directory; its contents are still read
            _walk(Path(entry.path), rel + "/", listing)
        elif is_audio:
            listing.inputs.append(rel)
        elif entry.is_symlink() and entry.is_dir():
            listing.ignored.append({"path": rel, "why": "symlinked folder, not followed"})
        elif Path(entry.name).suffix.lower() not in SIDECAR_EXTENSIONS:
            listing.ignored.append({"path": rel, "why": "not an audio extension"})


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _guess_text(raw: bytes) -> str:
    """Legacy 8-bit names are most often Windows-1252 (else Latin-1, which always decodes)."""
    try:
        return raw.decode("cp1252")
    except UnicodeDecodeError:
        return raw.decode("latin-1")
