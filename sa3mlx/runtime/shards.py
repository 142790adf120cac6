"""The two layouts of a derived data folder (normalize's and encode's output): `files` or `shards`.

`files`: one file per member (`<stem>.wav` + `<stem>.json`, `<stem>.npy` + `<stem>.json`).
`shards`: the same members packed into `shards/NNN-<md5 prefix>.tar` (NNN: one of SHARD_COUNT hash
buckets of the member's path without its suffix, so an item's audio/latent and its json share a
shard), uncompressed, in sorted order, with fixed headers (mtime 0, uid/gid 0, mode 0644: the same
members give the same bytes and so the same name), plus an index (member -> shard, byte offset of
its data, size; the size of every shard) under the key `shard_index` of the folder's summary file
(normalize's report.json, encode's details.json), which sits beside the shards and is rewritten
on every run anyway: one changed item changes one shard and that file, so DVC stores and pushes two
objects for the folder plus its listing. A member is one seek away and a plain `tar -xf` of every
shard gives the `files` tree.

Crash safety: a shard is written to a temporary file and renamed to its content-derived name, the
summary with the index last, and only then the shards it no longer names are deleted; so whatever
kills the process, the index on disk names a complete, consistent set of shards (old or new).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from sa3mlx.runtime.errors import ArtifactError, ParamError, one_line, reading
from sa3mlx.runtime.io import atomic_path, remove_stale, save_json, sha256_file

LAYOUTS = ("files", "shards", "auto")
SHARDS_DIR = "shards"
INDEX_KEY = "shard_index"  # the key of the summary file that holds the index
NORMALIZE_REPORT = "report.json"  # the summary file of data/normalized (normalize's census)
ENCODE_DETAILS = "details.json"  # the summary file of data/latents (underfit's details + ours)
SHARD_COUNT = 256  # hash buckets per folder: at 100,000 clips about 390 clips a shard
AUTO_SHARDS_ABOVE = 2000  # `auto`: shards above this many clips (a no-op `dvc status` of `files` passes 2 s there)
INDEX_FORMAT = 1
STAGING_DIR = ".staging"  # members written to disk before they are packed (shards layout), swept every run
_TAR_FORMAT = tarfile.PAX_FORMAT  # plain ustar headers; a pax record only for long or non-ASCII names


def choose_layout(layout: str, clips: int, param: str) -> str:
    """`files` / `shards` as asked; `auto`: shards above AUTO_SHARDS_ABOVE clips."""
    if layout not in LAYOUTS:
        raise ParamError(param, f"expected one of {', '.join(LAYOUTS)}", layout)
    if layout == "auto":
        return "shards" if clips > AUTO_SHARDS_ABOVE else "files"
    return layout


def shard_of(name: str) -> str:
    """The bucket `NNN` of a member: a hash of its path without the suffix (stable when items come and go)."""
    stem = str(PurePosixPath(name).with_suffix(""))
    number = int.from_bytes(hashlib.sha1(stem.encode()).digest()[:4], "big") % SHARD_COUNT
    return f"{number:03d}"


@dataclass(frozen=True)
class Span:
    """Where a member's bytes lie: `size` bytes at `offset` of `path` (offset 0 for a plain file)."""

    path: Path
    offset: int
    size: int
    label: str  # how messages name it: the file, or `shard.tar:member`
    member: str | None = None  # its name inside a shard (None: a plain file)

    def damaged(self, what: str, reason: str) -> ArtifactError:
        """The error for damaged bytes here: names the file (and the member of a shard) and the fix."""
        inside = f" {self.member}" if self.member else ""
        return ArtifactError(self.path, f"damaged {what}{inside} ({reason})")

    def read(self, what: str = "member") -> bytes:
        with reading(self.path, what), open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.size)
        if len(data) != self.size:
            raise self.damaged(what, f"truncated: {len(data)} of {self.size} bytes")
        return data

    def load_json(self, what: str = "JSON member") -> dict:
        """The member as a JSON object."""
        try:
            value = json.loads(self.read(what).decode("utf-8"))
        except (UnicodeError, ValueError) as e:
            raise self.damaged(what, one_line(e)) from None
        if not isinstance(value, dict):
            raise self.damaged(what, f"expected a JSON object, found {type(value).__name__}")
        return value

    def copy_to(self, out) -> None:
        with reading(self.path, "member"), open(self.path, "rb") as f:
            f.seek(self.offset)
            _copy_exact(f, out, self)

    def load_npy(self, mmap: bool = True, what: str = "latents") -> np.ndarray:
        """The .npy member as an array, memory-mapped read-only where possible (one seek)."""
        with reading(self.path, what), open(self.path, "rb") as f:
            f.seek(self.offset)
            try:
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = read_header(f)
            except ValueError as e:
                raise self.damaged(what, f"not a .npy array: {one_line(e)}") from None
            header = f.tell() - self.offset
            count = int(np.prod(shape, dtype=np.int64))
            if header + count * dtype.itemsize != self.size:
                raise self.damaged(what, f"{self.size} bytes do not hold a {dtype} array of shape {shape}")
            if mmap and count and not dtype.hasobject:
                order = "F" if fortran else "C"
                return np.memmap(f, dtype, "r", self.offset + header, shape, order)
            data = np.frombuffer(f.read(count * dtype.itemsize), dtype)
        return data.reshape(shape, order="F" if fortran else "C")


def _copy_exact(src, dst, span: Span) -> None:
    left = span.size
    while left:
        block = src.read(min(left, 1 << 20))
        if not block:
            raise span.damaged("member", f"truncated: {span.size - left} of {span.size} bytes")
        dst.write(block)
        left -= len(block)


class Tree:
    """The members of a data folder in either layout: name -> Span."""

    def __init__(self, root: Path, spans: dict[str, Span], layout: str):
        self.root, self.spans, self.layout = root, spans, layout

    def names(self) -> list[str]:
        return sorted(self.spans)

    def __contains__(self, name: str) -> bool:
        return name in self.spans

    def span(self, name: str) -> Span:
        return self.spans[name]

    def read(self, name: str) -> bytes:
        return self.spans[name].read()


def read_summary(path: Path) -> dict | None:
    """A folder's summary file as a dict (None if absent); unreadable is an ArtifactError naming the fix."""
    if not path.is_file():
        return None
    with reading(path, "summary file"):
        data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def open_tree(root: str | os.PathLike, summary: str | None = None) -> Tree:
    """The members under `root`: from the index in its `summary` file (shards), else its files (all
    but the summary; hidden names skipped)."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(root, "missing folder")
    found = read_summary(root / summary) if summary else None
    if found is not None and INDEX_KEY in found:
        return Tree(root, read_index(found[INDEX_KEY], root / summary, lambda shard: root / shard), "shards")
    spans = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            path = Path(folder, name)
            rel = path.relative_to(root).as_posix()
            if not name.startswith(".") and rel != summary:
                spans[rel] = Span(path, 0, path.stat().st_size, str(path))
    return Tree(root, spans, "files")


def read_index(index: dict, where: Path, locate, check_sizes: bool = True) -> dict[str, Span]:
    """The spans of an index (`where`: the file holding it); `locate(shard)` -> the shard file's path."""
    try:
        shards, members = index["shards"], index["members"]
        paths = {shard: Path(locate(shard)) for shard in shards}
        spans = {
            name: Span(paths[shard], offset, size, f"{paths[shard]}:{name}", name)
            for name, (shard, offset, size) in members.items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ArtifactError(where, f"damaged shard index ({type(e).__name__}: {one_line(e)})") from None
    if check_sizes:
        for shard, size in shards.items():
            if not paths[shard].is_file():
                raise ArtifactError(paths[shard], f"missing shard (the index in {where.name} names it)")
            actual = paths[shard].stat().st_size
            if actual != size:
                raise ArtifactError(
                    paths[shard], f"damaged shard ({actual} bytes, the index in {where.name} says {size})"
                )
    return spans


class TreeWriter:
    """Writes the members of a data folder in one layout; `finish()` removes what the run did not write.

    Members are added as bytes, as a file, or as a Span of another file (a shard or cache object);
    in the files layout each is written (atomically) at once, in the shards layout they are packed
    by `finish()`.
    """

    def __init__(self, root: str | os.PathLike, layout: str):
        if layout not in ("files", "shards"):
            raise ValueError(f"layout {layout!r}: expected files or shards")
        self.root, self.layout = Path(root), layout
        self.sources: dict[str, bytes | Span] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.root / STAGING_DIR, ignore_errors=True)

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def staging_path(self, name: str) -> Path:
        """Where a member that must be written to a file first (audio) goes: its final place in the
        files layout, a scratch file packed later in the shards layout."""
        base = self.root if self.layout == "files" else self.root / STAGING_DIR
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def add_staged(self, name: str) -> None:
        path = self.staging_path(name)
        self.sources[name] = Span(path, 0, path.stat().st_size, str(path))

    def add_bytes(self, name: str, data: bytes) -> None:
        if self.layout == "files":
            with atomic_path(self.root / name) as tmp:
                tmp.write_bytes(data)
        self.sources[name] = data

    def add_span(self, name: str, span: Span) -> None:
        if self.layout == "files":
            with atomic_path(self.root / name) as tmp, open(tmp, "wb") as out:
                span.copy_to(out)
        self.sources[name] = span

    def finish(self, summary_name: str, summary: dict) -> None:
        """Pack the shards (shards layout), write the summary file (with the index), then delete
        every file under root that is neither a member, nor the summary, nor a shard it names."""
        keep = {summary_name}
        if self.layout == "shards":
            index = self._write_shards()
            summary = {**summary, INDEX_KEY: index}
            keep |= set(index["shards"])
        else:
            keep |= set(self.sources)
        save_json(self.root / summary_name, summary)
        shutil.rmtree(self.root / STAGING_DIR, ignore_errors=True)
        remove_stale(self.root, keep)

    def _write_shards(self) -> dict:
        groups: dict[str, list[str]] = {}
        for name in sorted(self.sources):
            groups.setdefault(shard_of(name), []).append(name)
        index = {"format": INDEX_FORMAT, "shards": {}, "members": {}}
        for bucket, names in sorted(groups.items()):
            shard, members, size = self._write_shard(bucket, names)
            index["shards"][shard] = size
            index["members"].update({name: [shard, offset, length] for name, (offset, length) in members.items()})
        return index

    def _write_shard(self, bucket: str, names: list[str]) -> tuple[str, dict, int]:
        """Pack one bucket into a scratch file, then rename it to `shards/<bucket>-<sha256 prefix>.tar`."""
        packed = self.root / STAGING_DIR / f".{bucket}.tar"  # hidden: never a member's name
        with atomic_path(packed) as tmp, open(tmp, "wb") as f:
            members = write_tar(f, names, self.sources)
        shard = f"{SHARDS_DIR}/{bucket}-{sha256_file(packed)[:16]}.tar"
        (self.root / SHARDS_DIR).mkdir(exist_ok=True)
        size = packed.stat().st_size
        os.replace(packed, self.root / shard)
        return shard, members, size


def write_tar(f, names: list[str], sources: dict[str, bytes | Span]) -> dict[str, tuple[int, int]]:
    """Members `names` (in this order) as an uncompressed tar with fixed headers; {name: (offset, size)}."""
    placed = {}
    with tarfile.open(fileobj=f, mode="w", format=_TAR_FORMAT) as tar:
        for name in names:
            source = sources[name]
            info = tarfile.TarInfo(name)
            info.size = len(source) if isinstance(source, bytes) else source.size
            info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
            if isinstance(source, bytes):
                tar.addfile(info, io.BytesIO(source))
            else:
                with open(source.path, "rb") as src:
                    src.seek(source.offset)
                    tar.addfile(info, src)
            blocks = -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            placed[name] = (tar.offset - blocks, info.size)
    return placed


def export_tree(root: str | os.PathLike, out: str | os.PathLike, summary: str | None = None) -> int:
    """Write every member of `root` (either layout) as a plain file under `out`; returns how many."""
    tree, out = open_tree(root, summary), Path(out)
    for name in tree.names():
        with atomic_path(out / name) as tmp, open(tmp, "wb") as f:
            tree.span(name).copy_to(f)
    return len(tree.spans)
