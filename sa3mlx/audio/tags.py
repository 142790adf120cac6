"""Tags of one input: the first non-empty of its sidecars, else its embedded metadata.

Order (like underfit's pre-encode): `<dir>/<stem>.json`, `<dir>/../json/<stem>.json`,
`<dir>/<stem>.txt`, `<dir>/../txt/<stem>.txt` (whole text -> {"prompt": text}), then embedded
tags (title, artist, album, genre, label, date, composer, bpm) read with mutagen. Sibling
folders are looked up only inside the dataset root. Every value becomes a clean string.
"""

from __future__ import annotations

import codecs
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import mutagen

EMBEDDED_KEYS = ("title", "artist", "album", "genre", "label", "date", "composer", "bpm")
# mutagen's "easy" names that carry the label (ID3 TPUB is "organization")
LABEL_ALIASES = ("label", "organization", "publisher")
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass
class Tags:
    values: dict[str, str]
    source: str  # the sidecar's path relative to the root, "embedded" or "none"
    warnings: list[str] = field(default_factory=list)


def find_tags(audio_path: Path, root: Path, fileobj: BinaryIO | None = None) -> Tags:
    warnings: list[str] = []
    for sidecar in sidecar_candidates(audio_path, root):
        if not sidecar.is_file():
            continue
        label = sidecar.relative_to(root).as_posix()
        values = _read_sidecar(sidecar, label, warnings)
        if values:
            return Tags(values, label, warnings)
    values = embedded_tags(fileobj if fileobj is not None else audio_path, warnings)
    return Tags(values, "embedded" if values else "none", warnings)


def sidecar_candidates(audio_path: Path, root: Path) -> list[Path]:
    folder, stem = audio_path.parent, audio_path.stem
    nested = folder != root  # ../json and ../txt must stay inside the dataset
    names = [folder / f"{stem}.json"]
    names += [folder.parent / "json" / f"{stem}.json"] if nested else []
    names += [folder / f"{stem}.txt"]
    names += [folder.parent / "txt" / f"{stem}.txt"] if nested else []
    return names


def decode_text(data: bytes) -> tuple[str, str | None]:
    """Bytes of a text file -> (text, warning or None); never fails."""
    for bom, codec in (
        (codecs.BOM_UTF8, "utf-8"),
        (codecs.BOM_UTF16_LE, "utf-16-le"),
        (codecs.BOM_UTF16_BE, "utf-16-be"),
    ):
        if data.startswith(bom):
            return data[len(bom) :].decode(codec, "replace"), None
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        pass
    try:
        return data.decode("cp1252"), "not UTF-8; read as Windows-1252"
    except UnicodeDecodeError:
        return data.decode("latin-1"), "not UTF-8; read as Latin-1"


def clean_value(value) -> str | None:
    """A tag value as a clean string (NFC, no control characters, stripped); None if empty."""
    if value is None:
        return None
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        parts = [clean_value(v) for v in value]
        text = ", ".join(p for p in parts if p)
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    else:
        text = str(value)
    text = unicodedata.normalize("NFC", CONTROL_CHARS.sub("", text.replace("\r\n", "\n"))).strip()
    return text or None


def clean_tags(mapping: dict) -> dict[str, str]:
    out = {}
    for key, value in mapping.items():
        name, text = clean_value(key), clean_value(value)
        if name and text:
            out[name] = text
    return dict(sorted(out.items()))


def embedded_tags(source, warnings: list[str]) -> dict[str, str]:
    """title, artist, album, genre, label, date, composer, bpm from the file's own metadata."""
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        media = mutagen.File(source, easy=True)
    except Exception as e:  # mutagen raises many types on odd files; tags are optional
        warnings.append(f"embedded tags unreadable ({type(e).__name__}: {e})")
        return {}
    if media is None or not media.tags:
        return {}
    found = {}
    for key in EMBEDDED_KEYS:
        for alias in LABEL_ALIASES if key == "label" else (key,):
            value = _first(media.tags, alias)
            if value is not None:
                found[key] = value
                break
    return clean_tags(found)


def _first(tags, key):
    try:
        values = tags.get(key)
    except Exception:  # some mutagen tag maps raise on names they do not know
        return None
    if isinstance(values, (list, tuple)):
        return values[0] if values else None
    return values


def _read_sidecar(path: Path, label: str, warnings: list[str]) -> dict[str, str]:
    try:
        text, warning = decode_text(path.read_bytes())
    except OSError as e:
        warnings.append(f"{label}: unreadable ({e.strerror})")
        return {}
    if warning:
        warnings.append(f"{label}: {warning}")
    if path.suffix == ".txt":
        prompt = clean_value(text)
        return {"prompt": prompt} if prompt else {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        warnings.append(f"{label}: invalid JSON ({e.msg} at line {e.lineno}); ignored")
        return {}
    if not isinstance(data, dict):
        warnings.append(f"{label}: JSON is a {type(data).__name__}, not an object; ignored")
        return {}
    return clean_tags(data)
