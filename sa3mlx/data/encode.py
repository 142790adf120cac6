"""The `encode` stage's work: data/normalized/ -> data/latents/ (SAME latents + sidecars).

For each normalised audio file, in sorted order: hash its bytes, look the (audio, codec,
params) key up in the content cache (`encode_cache`), encode on a miss (SAME encoder, fp32,
production chunking above `chunk_above_seconds`, no pre-padding), then write
`<relpath>.npy` ([latent_dim, T] float32, unscaled) and `<relpath>.json` (the sidecar of
underfit's pre-encode) atomically, one file each or packed in tar shards (`layout`);
`details.json` lists each npy's cache key under `cache_keys`. Either layout of data/normalized/ is read. The cache lives
outside the output folder, so a run that starts from an empty output (as `dvc repro` does)
re-encodes only what the cache lacks, and a killed run resumes where it stopped. What the
machine-local cache lacks is then looked up, by key, in the previous output (the version
dvc.lock records, read from the DVC cache, `sa3mlx/runtime/previous.py`): a teammate who pulled
the outputs encodes only new audio. Both sources are verified (sha256 / md5) before reuse.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import mlx.core as mx
import numpy as np
import soundfile as sf

from sa3mlx.data.encode_cache import Entry, LatentCache, entry_key, remove_temporaries
from sa3mlx.models.config import AutoencoderConfig
from sa3mlx.models.same import SameEncoder, autoencoder_config, load_same_encoder
from sa3mlx.models.same_chunked import encode_long, latent_mask
from sa3mlx.runtime.artifacts import read_json, verify_listed
from sa3mlx.runtime.errors import LOAD_ERRORS, ArtifactError, ParamError, UserError, one_line
from sa3mlx.runtime.io import save_json, sha256_file
from sa3mlx.runtime.layout import ENCODE_SHARE_FILE, MODEL_CONFIG_FILE, SAME_ENCODER_FILE, SAMPLE_RATE
from sa3mlx.runtime.params import dataclass_from_params
from sa3mlx.runtime.previous import PreviousOutput
from sa3mlx.runtime.schema import choice, integer, number, spec
from sa3mlx.runtime.shards import (
    ENCODE_DETAILS,
    LAYOUTS,
    NORMALIZE_REPORT,
    Span,
    Tree,
    TreeWriter,
    choose_layout,
    open_tree,
)

AUDIO_EXTENSIONS = (".wav", ".flac")  # what `normalize` writes
DETAILS_FILE = ENCODE_DETAILS
CACHE_KEYS = "cache_keys"  # details.json: {npy member: cache key}, what lets a later run reuse a latent
REPORT_FILE = NORMALIZE_REPORT  # normalize's census: maps outputs to their raw sources
RESERVED_ROOT_STEMS = ("details", "silence")  # details.json is ours; silence.npy pads clips in the dataset
ENCODE_VERSION = 1  # part of every cache key: bump when the computation changes
SIDECAR_FIELDS = (
    "path",
    "relpath",
    "src_relpath",
    "seconds_total",
    "seconds_start",
    "audio_samples",
    "latent_shape",
    "padding_mask",
)


@dataclass(frozen=True)
class EncodeOptions:
    chunk_latents: int = field(default=128, metadata=spec(integer(1)))  # production chunking: chunk length in latents
    overlap: int = field(default=32, metadata=spec(integer(0)))  # latents shared by neighbours (half dropped each side)
    chunk_above_seconds: float = field(default=30.0, metadata=spec(number(0)))  # longer files: chunked
    shard: str | None = None  # "i/n": encode only this process's share of the files
    layout: str = field(default="files", metadata=spec(choice(LAYOUTS)))  # files|shards|auto (runtime/shards.py)

    @classmethod
    def from_params(cls, params: dict) -> EncodeOptions:
        options = dataclass_from_params(cls, params, "encode")
        options.validate()
        return options

    def validate(self) -> None:
        if not (isinstance(self.chunk_latents, int) and isinstance(self.overlap, int)):
            raise ParamError("encode.chunk_latents", "chunk_latents and overlap must be whole numbers of latents")
        if not 0 <= self.overlap < self.chunk_latents:
            bound = f"expected a whole number in [0, chunk_latents={self.chunk_latents})"
            raise ParamError("encode.overlap", bound, self.overlap)
        if self.chunk_above_seconds < 0:
            raise ParamError("encode.chunk_above_seconds", "expected a number >= 0", self.chunk_above_seconds)
        parse_shard(self.shard)

    def fingerprint(self) -> dict:
        """What changes the latents (the shard and the layout do not)."""
        return {
            "chunk_latents": self.chunk_latents,
            "overlap": self.overlap,
            "chunk_above_seconds": float(self.chunk_above_seconds),
            "version": ENCODE_VERSION,
        }


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """ "i/n" -> (i, n) with 0 <= i < n; None -> None."""
    if text is None:
        return None
    try:
        index, count = (int(part) for part in str(text).split("/"))
    except ValueError:
        raise ParamError("encode.shard", "expected 'i/n' (e.g. '0/4') or null", text) from None
    if not 0 <= index < count:
        raise ParamError("encode.shard", "expected 'i/n' with 0 <= i < n", text)
    return index, count


def in_shard(relpath: str, shard: tuple[int, int] | None) -> bool:
    """Stable assignment by a hash of the path: adding files never moves others between shards."""
    if shard is None:
        return True
    digest = int(hashlib.sha256(relpath.encode()).hexdigest()[:16], 16)
    return digest % shard[1] == shard[0]


@dataclass
class Codec:
    """The SAME encoder of a converted model folder; weights load on first use."""

    folder: Path
    config: AutoencoderConfig
    sample_rate: int
    sha256: str  # fingerprint of the weights and everything in the config the encoder uses
    _encoder: SameEncoder | None = None

    @classmethod
    def open(cls, folder: str | os.PathLike) -> Codec:
        folder = Path(folder)
        config = autoencoder_config(folder)
        sample_rate = int(read_json(folder / MODEL_CONFIG_FILE, "model config").get("sample_rate", SAMPLE_RATE))
        described = {
            "weights": sha256_file(verify_listed(folder / SAME_ENCODER_FILE, "SAME encoder weights")),
            "encoder": asdict(config.encoder),
            "latent_dim": config.latent_dim,
            "patch_size": config.patch_size,
            "audio_channels": config.audio_channels,
            "sample_rate": sample_rate,
            "downsampling_ratio": config.downsampling_ratio,
        }
        digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
        return cls(folder, config, sample_rate, digest)

    @property
    def encoder(self) -> SameEncoder:
        if self._encoder is None:
            self._encoder = load_same_encoder(self.folder / SAME_ENCODER_FILE, self.config)
        return self._encoder


def encode_audio(
    encoder: SameEncoder, audio: np.ndarray, sample_rate: int, options: EncodeOptions
) -> tuple[np.ndarray, np.ndarray]:
    """[channels, samples] float32 -> (latents [latent_dim, T], mask [T] bool); T = the unchunked count."""
    batch = audio[None]
    if audio.shape[-1] > options.chunk_above_seconds * sample_rate:
        latents, mask = encode_long(encoder, batch, options.chunk_latents, options.overlap)
    else:
        latents = encoder(mx.array(batch))
        mask = latent_mask(audio.shape[-1], latents.shape[-1], encoder.samples_per_latent)
    mx.eval(latents)
    return np.array(latents[0], dtype=np.float32), mask[0]


def list_audio(root: str | os.PathLike | Tree) -> list[str]:
    """Sorted "/"-separated relpaths of the audio members of a normalised folder (either layout)."""
    tree = root if isinstance(root, Tree) else open_tree(root, REPORT_FILE)
    return [name for name in tree.names() if name.lower().endswith(AUDIO_EXTENSIONS)]


def read_census(root: str | os.PathLike) -> dict[str, dict]:
    """{normalised relpath: its record (source, samples, ...)} from normalize's report (empty without one)."""
    report = Path(root) / REPORT_FILE
    if not report.is_file():
        return {}
    rows = read_json(report, "normalize census").get("files", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ArtifactError(report, "damaged normalize census (files is not a list of objects)")
    return {r["output"]: r for r in rows if "output" in r}


def read_tags(tree: Tree, audio: str) -> dict[str, str]:
    """The tags member `<stem>.json` next to audio member `audio` ({} without one)."""
    name = str(PurePosixPath(audio).with_suffix(".json"))
    if name not in tree:
        return {}
    return {str(k): str(v) for k, v in tree.span(name).load_json("tag sidecar").items()}


def latent_stem(relpath: str) -> str:
    """Output path without extension; root names the latent folder reserves get `-audio`."""
    stem = str(PurePosixPath(relpath).with_suffix(""))
    if "/" not in stem and stem.casefold() in RESERVED_ROOT_STEMS:
        stem += "-audio"
    return stem


def sidecar(
    path: str,
    npy_relpath: str,
    src_relpath: str,
    samples: int,
    sample_rate: int,
    latent_shape: list[int],
    mask: list[int],
    tags: dict[str, str],
) -> tuple[dict, list[str]]:
    """underfit's sidecar fields, then the tags; returns (sidecar, tag keys dropped as clashing)."""
    meta = {
        "path": path,
        "relpath": npy_relpath,
        "src_relpath": src_relpath,
        "seconds_total": round(samples / sample_rate, 3),
        "seconds_start": 0,
        "audio_samples": samples,
        "latent_shape": list(latent_shape),
        "padding_mask": list(mask),
    }
    clashes = sorted(k for k in tags if k in meta)
    meta.update({k: v for k, v in tags.items() if k not in meta})
    return meta, clashes


@dataclass
class Summary:
    total: int = 0
    encoded: int = 0
    skipped: int = 0
    errors: list[dict] = field(default_factory=list)
    seconds_total: float = 0.0  # audio written to the output
    wall: float = 0.0

    def line(self) -> str:
        """The line underfit's dashboard parses."""
        return (
            f"Done in {format_duration(self.wall)}: {self.encoded} encoded, {self.skipped} skipped, "
            f"{len(self.errors)} errors"
        )


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """One `[i/N]` line per file; rates count encoding work only (cache hits are free)."""

    def __init__(self, total: int, log):
        self.total, self.log = total, log
        self.files = 0
        self.audio_seconds = 0.0
        self.busy = 0.0

    def encoded(self, index: int, name: str, audio_seconds: float, wall: float) -> None:
        self.files += 1
        self.audio_seconds += audio_seconds
        self.busy += wall
        self.log(
            f"[{index}/{self.total}] {name}: encoded {audio_seconds:.1f} s in {wall:.2f} s | "
            f"{self.files / self.busy:.2f} files/s, {self.audio_seconds / self.busy:.1f} audio-s/s"
        )

    def cached(self, index: int, name: str, how: str = "cached") -> None:
        self.log(f"[{index}/{self.total}] {name}: {how}")

    def failed(self, index: int, name: str, error: str) -> None:
        self.log(f"[{index}/{self.total}] {name}: ERROR {error}")


def encode_dir(
    normalized: str | os.PathLike,
    latents: str | os.PathLike,
    cache: str | os.PathLike,
    codec: Codec,
    options: EncodeOptions,
    model: str = "",
    log=print,
    previous: PreviousOutput | None = None,
) -> Summary:
    """Encode every audio file of `normalized` (this shard's share) into `latents`; `previous`: an
    earlier output of this stage whose latents are reused (by key) where the local cache lacks them."""
    started = time.perf_counter()
    normalized, latents = Path(normalized), Path(latents)
    shard = parse_shard(options.shard)
    store = LatentCache(cache)
    store.ignore_in_git()
    if shard is None:  # shards may run side by side: only a lone run may sweep temporaries
        store.remove_leftovers()
    tree = open_tree(normalized, REPORT_FILE)
    files = [rel for rel in list_audio(tree) if in_shard(rel, shard)]
    census = read_census(normalized)
    restorer = Restorer(previous, store)
    # a share of the work writes its files as they come (shares may run side by side); the lone run packs
    writer = TreeWriter(latents, "files" if shard else choose_layout(options.layout, len(files), "encode.layout"))
    summary, progress = Summary(total=len(files)), Progress(len(files), log)
    keys = {}
    for index, rel in enumerate(files, 1):
        started_file = time.perf_counter()
        stem = latent_stem(rel)
        try:
            if f"{stem}.npy" in writer:
                raise UserError(f"{rel}: its output name {stem}.npy is taken by another file; rename one of them")
            record = census.get(rel, {})
            job = Job(tree, normalized, rel, stem, record.get("source", rel), record.get("samples"))
            meta, how, keys[f"{stem}.npy"] = _encode_one(job, writer, store, restorer, codec, options, log)
        except Exception as e:  # one bad file never stops the rest
            error = one_line(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            summary.errors.append({"path": rel, "error": error, "user": isinstance(e, UserError)})
            progress.failed(index, rel, error)
            continue
        summary.seconds_total += meta["seconds_total"]
        if how == ENCODED:
            summary.encoded += 1
            progress.encoded(index, rel, meta["audio_samples"] / codec.sample_rate, time.perf_counter() - started_file)
        else:
            summary.skipped += 1
            progress.cached(index, rel, how)
    if restorer.damaged:
        log(f"encode: damaged in the DVC cache, encoded again: {', '.join(restorer.damaged)}")
    for dropped in store.dropped:
        log(f"encode: dropped a damaged cache entry {dropped} (its file was encoded again)")
    if shard is None:
        remove_temporaries(latents)
        writer.finish(DETAILS_FILE, {**details(codec, options, model, normalized, summary), CACHE_KEYS: keys})
    else:  # what a train run on this folder must be told: it holds one share of the corpus
        save_json(latents / ENCODE_SHARE_FILE, {"shard": options.shard, "files": len(files)})
    summary.wall = time.perf_counter() - started
    return summary


ENCODED, CACHED, RESTORED = "encoded", "cached", "reused from the previous output"


@dataclass(frozen=True)
class Job:
    tree: Tree  # the normalised folder's members
    normalized: Path
    rel: str  # the audio member
    stem: str  # the output name without suffix
    src_rel: str  # the raw file it came from
    samples: int | None = None  # its length by normalize's census


class Restorer:
    """Cache entries rebuilt from the previous output's latents (by key), verified before use."""

    def __init__(self, previous: PreviousOutput | None, store: LatentCache):
        self.previous, self.store = previous, store
        found = previous.summary if previous is not None else None
        keys = found.get(CACHE_KEYS) if isinstance(found, dict) else None
        self.names = {key: name for name, key in keys.items()} if isinstance(keys, dict) else {}

    @property
    def damaged(self) -> list[str]:
        return self.previous.damaged if self.previous is not None else []

    def restore(self, key: str) -> Entry | None:
        name = self.names.get(key)
        if name is None:
            return None
        npy, side = self.previous.member(name), self.previous.member(f"{name[: -len('.npy')]}.json")
        if npy is None or side is None:
            return None
        try:
            meta = side.load_json("latent sidecar")
            shape, mask = list(npy.load_npy(mmap=False).shape), meta["padding_mask"]
            if shape != meta["latent_shape"] or len(mask) != shape[-1]:
                return None
            about = {"restored_from": f"{self.previous.label}/{name}"}
            return self.store.put_npy(key, npy.read(), shape, mask, meta["audio_samples"], about)
        except (ArtifactError, KeyError, TypeError, ValueError):  # not reusable: encoded again
            return None


def decode_normalized(where: Span, data: bytes, samples: int | None = None) -> tuple[np.ndarray, int]:
    """([samples, channels] float32, rate) of a normalized member's bytes; damage (or a length other
    than the census's `samples`: a truncated file decodes) is an ArtifactError naming the member."""
    try:
        audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except LOAD_ERRORS as e:
        raise where.damaged("normalized audio", one_line(e) or type(e).__name__) from e
    if samples is not None and audio.shape[0] != samples:
        raise where.damaged("normalized audio", f"{audio.shape[0]} samples; {REPORT_FILE} says {samples}")
    return audio, rate


def _encode_one(
    job: Job, writer: TreeWriter, store: LatentCache, restorer: Restorer, codec: Codec, options: EncodeOptions, log
) -> tuple[dict, str, str]:
    """Encode one file (or find it in the cache or the previous output) and write its npy + sidecar;
    (sidecar, how it was obtained, its cache key)."""
    data = job.tree.read(job.rel)
    key = entry_key(hashlib.sha256(data).hexdigest(), codec.sha256, options.fingerprint())
    how, entry = CACHED, store.get(key)
    if entry is None:
        how, entry = RESTORED, restorer.restore(key)
    audio_path = job.normalized / job.rel
    if entry is None:
        how, entry = ENCODED, _encode_entry(data, job, key, store, codec, options)
    meta, clashes = sidecar(
        audio_path.as_posix(),
        f"{job.stem}.npy",
        job.src_rel,
        entry.audio_samples,
        codec.sample_rate,
        entry.latent_shape,
        entry.mask,
        read_tags(job.tree, job.rel),
    )
    if clashes:
        log(f"  {audio_path.name}: tags {clashes} clash with sidecar fields and were left out")
    writer.add_span(f"{job.stem}.npy", Span(entry.latents, 0, entry.latents.stat().st_size, str(entry.latents)))
    writer.add_bytes(f"{job.stem}.json", sidecar_bytes(meta))
    return meta, how, key


def _encode_entry(data: bytes, job: Job, key: str, store: LatentCache, codec: Codec, options: EncodeOptions) -> Entry:
    where = job.tree.span(job.rel)
    audio, rate = decode_normalized(where, data, job.samples)
    del data
    if rate != codec.sample_rate or audio.shape[1] != codec.config.audio_channels:
        inside = f" ({job.rel})" if where.member else ""
        raise ArtifactError(
            where.path,
            f"{rate} Hz {audio.shape[1]} channels{inside}, but the codec takes {codec.sample_rate} Hz "
            f"{codec.config.audio_channels} channels",
            "normalize it again: `dvc repro -f normalize`",
        )
    latent, mask = encode_audio(codec.encoder, np.ascontiguousarray(audio.T), rate, options)
    about = {
        "source": (job.normalized / job.rel).as_posix(),
        "codec_sha256": codec.sha256,
        "params": options.fingerprint(),
    }
    return store.put(key, latent, mask, audio.shape[0], about)


def sidecar_bytes(meta: dict) -> bytes:
    """One compact line in underfit's field order (a 10-minute file has a 6459-entry mask)."""
    return (json.dumps(meta, ensure_ascii=False) + "\n").encode("utf-8")


def details(codec: Codec, options: EncodeOptions, model: str, normalized: Path, summary: Summary) -> dict:
    """`details.json` at the latent root (underfit's fields; only facts of the inputs, not of the cache)."""
    cfg = codec.config
    return {
        "model": model,
        "codec_sha256": codec.sha256,
        "sample_rate": codec.sample_rate,
        "audio_channels": cfg.audio_channels,
        "downsampling_ratio": cfg.downsampling_ratio,
        "latent_dim": cfg.latent_dim,
        "scale": 1.0,
        "half": False,
        "max_samples": None,
        "input_dir": normalized.as_posix(),
        "num_files": summary.total - len(summary.errors),
        "seconds_total": round(summary.seconds_total, 3),
        "num_errors": len(summary.errors),
        "encode": {k: v for k, v in options.fingerprint().items() if k != "version"},
    }
