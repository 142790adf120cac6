"""A stage's previous output, as `dvc.lock` records it and the DVC cache holds it, for reuse.

`dvc repro` deletes a stage's outputs before running it, and a teammate's clone has only what
`dvc pull` put in the cache, so the previous version is read where DVC keeps it: `dvc.lock` names the
output's directory object (`<md5>.dir`), the cache (`.dvc/cache/files/md5/ab/cdef…`, or `cache.dir`)
holds that listing and every file of it, each named by the md5 of its bytes. Every object is
checked against its name before anything of it is used, so a damaged or missing object is simply
not reused (the stage computes that item again); nothing here is ever required to exist.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml

from sa3mlx.runtime.errors import ArtifactError
from sa3mlx.runtime.shards import INDEX_KEY, Span, read_index

LOCK_FILE = "dvc.lock"


def md5_file(path: Path) -> str | None:
    digest = hashlib.md5()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def cache_dir(root: Path) -> Path:
    """The project's DVC cache folder (`cache.dir` if configured, else .dvc/cache)."""
    try:
        from dvc.config import Config

        configured = Config(dvc_dir=str(root / ".dvc"))["cache"].get("dir")
    except Exception:  # no or unreadable DVC config: the default place
        configured = None
    return Path(configured) if configured else root / ".dvc" / "cache"


def locked_dir_md5(root: Path, out: str) -> str | None:
    """The md5 of `out`'s directory object in dvc.lock (DVC 3 `hash: md5` entries only)."""
    try:
        lock = yaml.safe_load((root / LOCK_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    for stage in (lock.get("stages") or {}).values():
        for entry in stage.get("outs") or [] if isinstance(stage, dict) else []:
            if not isinstance(entry, dict) or entry.get("path") != out or entry.get("hash") != "md5":
                continue
            if str(entry.get("md5", "")).endswith(".dir"):
                return entry["md5"]
    return None


class PreviousOutput:
    """The files of an output folder's last recorded version; members and root files, verified."""

    def __init__(self, label: str, objects: Path, listing: dict[str, str], summary: str):
        self.label, self.objects, self.listing = label, objects, listing
        self._checked: dict[Path, bool] = {}
        self.damaged: list[str] = []  # objects found but not matching their md5
        self.summary = self.read_json(summary)
        self.sharded = isinstance(self.summary, dict) and INDEX_KEY in self.summary
        self._shard_spans = self._read_shard_index(summary) if self.sharded else {}

    def object_path(self, md5: str) -> Path:
        return self.objects / md5[:2] / md5[2:]

    def _intact(self, md5: str, label: str) -> Path | None:
        path = self.object_path(md5)
        if path not in self._checked:
            self._checked[path] = ok = md5_file(path) == md5
            if not ok and path.exists():
                self.damaged.append(label)
        return path if self._checked[path] else None

    def file(self, rel: str) -> Path | None:
        """A file of the folder (a member of the files layout or a root file), if intact."""
        md5 = self.listing.get(rel)
        return None if md5 is None else self._intact(md5, f"{self.label}/{rel}")

    def read_json(self, rel: str):
        path = self.file(rel)
        try:
            return json.loads(path.read_text(encoding="utf-8")) if path else None
        except ValueError:
            return None

    def _read_shard_index(self, summary: str) -> dict[str, tuple[str, Span]]:
        shard_of_object = {}

        def locate(shard: str) -> Path:
            path = self.object_path(self.listing.get(shard, "0" * 32))
            shard_of_object[path] = shard
            return path

        try:
            spans = read_index(self.summary[INDEX_KEY], Path(self.label) / summary, locate, check_sizes=False)
        except ArtifactError:  # a damaged index: nothing to reuse
            return {}
        return {name: (shard_of_object[span.path], span) for name, span in spans.items()}

    def member(self, name: str) -> Span | None:
        """Where member `name` lies in the cache, if the object holding it is intact."""
        if not self.sharded:
            path = self.file(name)
            return None if path is None else Span(path, 0, path.stat().st_size, f"{self.label}/{name}")
        found = self._shard_spans.get(name)
        if found is None or self.listing.get(found[0]) is None:
            return None
        shard, span = found
        return span if self._intact(self.listing[shard], f"{self.label}/{shard}") else None


def previous_output(out: str, summary: str, root: str | os.PathLike = ".") -> PreviousOutput | None:
    """The version of output folder `out` (as spelled in dvc.yaml; `summary`: its summary file, which
    holds the shard index) that dvc.lock records, if the DVC cache holds its listing; None otherwise
    (first run, no DVC, a pull that left it out)."""
    root = Path(root)
    md5 = locked_dir_md5(root, out)
    if md5 is None:
        return None
    objects = cache_dir(root) / "files" / "md5"
    listing_path = objects / md5[:2] / md5[2:]
    if md5_file(listing_path) != md5.removesuffix(".dir"):
        return None
    try:
        entries = json.loads(listing_path.read_text())
        listing = {e["relpath"]: e["md5"] for e in entries}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return PreviousOutput(out, objects, listing, summary)
