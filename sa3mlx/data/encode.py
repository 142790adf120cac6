"""The `encode` stage's work: data/normalized/ -> data/latents/ (SAME latents + sidecars).

For each normalised audio file, in sorted order: hash its bytes, look the (audio, codec,
params) key up in the content cache (`encode_cache`), encode on a miss (SAME encoder, fp32,
production chunking above `chunk_above_seconds`, no pre-padding), then write
`<relpath>.npy` ([latent_dim, T] float32, unscaled) and `<relpath>.json` (the sidecar of
underfit's pre-encode) atomically. The cache lives outside the output folder, so a run that
starts from an empty output (as `dvc repro` does) re-encodes only what the cache lacks, and a
killed run resumes where it stopped.
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

from sa3mlx.data.encode_cache import LatentCache, entry_key, remove_temporaries
from sa3mlx.models.config import AutoencoderConfig
from sa3mlx.models.same import SameEncoder, autoencoder_config, load_same_encoder
from sa3mlx.models.same_chunked import encode_long, latent_mask
from sa3mlx.runtime.io import atomic_path, copy_atomic, remove_stale, save_json, sha256_file
from sa3mlx.runtime.params import dataclass_from_params

AUDIO_EXTENSIONS = (".wav", ".flac")  # what `normalize` writes
ENCODER_FILE = "same_encoder.npz"
DETAILS_FILE = "details.json"
REPORT_FILE = "report.json"  # normalize's census: maps outputs to their raw sources
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
    chunk_latents: int = 128  # production chunking: chunk length in latents
    overlap: int = 32  # latents shared by neighbouring chunks (half dropped on each side)
    chunk_above_seconds: float = 30.0  # longer files are encoded in chunks, shorter ones in one pass
    shard: str | None = None  # "i/n": encode only this process's share of the files

    @classmethod
    def from_params(cls, params: dict) -> EncodeOptions:
        options = dataclass_from_params(cls, params, "encode")
        options.validate()
        return options

    def validate(self) -> None:
        if not (isinstance(self.chunk_latents, int) and isinstance(self.overlap, int)):
            raise ValueError("encode.chunk_latents and encode.overlap must be whole numbers of latents")
        if not 0 <= self.overlap < self.chunk_latents:
            raise ValueError(f"encode.overlap {self.overlap} must be in [0, chunk_latents={self.chunk_latents})")
        if self.chunk_above_seconds < 0:
            raise ValueError(f"encode.chunk_above_seconds {self.chunk_above_seconds} must be >= 0")
        parse_shard(self.shard)

    def fingerprint(self) -> dict:
        """What changes the latents (the shard does not)."""
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
        raise ValueError(f"encode.shard {text!r}: expected 'i/n', e.g. '0/4'") from None
    if not 0 <= index < count:
        raise ValueError(f"encode.shard {text!r}: need 0 <= i < n")
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
        sample_rate = int(json.loads((folder / "model_config.json").read_text()).get("sample_rate", 44100))
        described = {
            "weights": sha256_file(folder / ENCODER_FILE),
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
            self._encoder = load_same_encoder(self.folder / ENCODER_FILE, self.config)
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


def list_audio(root: str | os.PathLike) -> list[str]:
    """Sorted "/"-separated relpaths of the audio files under `root` (hidden names skipped)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if not name.startswith(".") and name.lower().endswith(AUDIO_EXTENSIONS):
                found.append(Path(folder, name).relative_to(root).as_posix())
    return sorted(found)


def read_sources(root: str | os.PathLike) -> dict[str, str]:
    """{normalised relpath: raw relpath} from normalize's report (empty without one)."""
    report = Path(root) / REPORT_FILE
    if not report.is_file():
        return {}
    return {r["output"]: r["source"] for r in json.loads(report.read_text()).get("files", []) if "output" in r}


def read_tags(audio: Path) -> dict[str, str]:
    sidecar = audio.with_suffix(".json")
    if not sidecar.is_file():
        return {}
    tags = json.loads(sidecar.read_text(encoding="utf-8"))
    if not isinstance(tags, dict):
        raise ValueError(f"{sidecar}: tags must be a JSON object")
    return {str(k): str(v) for k, v in tags.items()}


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

    def cached(self, index: int, name: str) -> None:
        self.log(f"[{index}/{self.total}] {name}: cached")

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
) -> Summary:
    """Encode every audio file of `normalized` (this shard's share) into `latents`."""
    started = time.perf_counter()
    normalized, latents = Path(normalized), Path(latents)
    shard = parse_shard(options.shard)
    store = LatentCache(cache)
    store.ignore_in_git()
    if shard is None:  # shards may run side by side: only a lone run may sweep temporaries
        store.remove_leftovers()
    files = [rel for rel in list_audio(normalized) if in_shard(rel, shard)]
    sources = read_sources(normalized)
    summary, progress = Summary(total=len(files)), Progress(len(files), log)
    written = {DETAILS_FILE}
    for index, rel in enumerate(files, 1):
        started_file = time.perf_counter()
        stem = latent_stem(rel)
        try:
            if f"{stem}.npy" in written:
                raise ValueError(f"its output name {stem}.npy is taken by another file; rename one of them")
            meta, encoded = _encode_one(
                normalized / rel, latents, stem, sources.get(rel, rel), store, codec, options, log
            )
        except Exception as e:  # one bad file never stops the rest
            error = f"{type(e).__name__}: {e}"
            summary.errors.append({"path": rel, "error": error})
            progress.failed(index, rel, error)
            continue
        written.update({f"{stem}.npy", f"{stem}.json"})
        summary.seconds_total += meta["seconds_total"]
        if encoded:
            summary.encoded += 1
            progress.encoded(index, rel, meta["audio_samples"] / codec.sample_rate, time.perf_counter() - started_file)
        else:
            summary.skipped += 1
            progress.cached(index, rel)
    if shard is None:
        remove_temporaries(latents)
        remove_stale(latents, written)
        save_json(latents / DETAILS_FILE, details(codec, options, model, normalized, summary))
    summary.wall = time.perf_counter() - started
    return summary


def _encode_one(
    audio_path: Path,
    latents: Path,
    stem: str,
    src_rel: str,
    store: LatentCache,
    codec: Codec,
    options: EncodeOptions,
    log,
) -> tuple[dict, bool]:
    """Encode one file (or find it in the cache) and write its npy + sidecar; (sidecar, encoded?)."""
    data = audio_path.read_bytes()
    key = entry_key(hashlib.sha256(data).hexdigest(), codec.sha256, options.fingerprint())
    entry = store.get(key)
    encoded = entry is None
    if encoded:
        audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        del data
        if rate != codec.sample_rate or audio.shape[1] != codec.config.audio_channels:
            raise ValueError(
                f"{rate} Hz {audio.shape[1]} channels; the codec takes {codec.sample_rate} Hz "
                f"{codec.config.audio_channels} channels (run normalize)"
            )
        latent, mask = encode_audio(codec.encoder, np.ascontiguousarray(audio.T), rate, options)
        entry = store.put(
            key,
            latent,
            mask,
            audio.shape[0],
            {"source": audio_path.as_posix(), "codec_sha256": codec.sha256, "params": options.fingerprint()},
        )
    meta, clashes = sidecar(
        audio_path.as_posix(),
        f"{stem}.npy",
        src_rel,
        entry.audio_samples,
        codec.sample_rate,
        entry.latent_shape,
        entry.mask,
        read_tags(audio_path),
    )
    if clashes:
        log(f"  {audio_path.name}: tags {clashes} clash with sidecar fields and were left out")
    copy_atomic(entry.latents, latents / f"{stem}.npy")
    write_sidecar(latents / f"{stem}.json", meta)
    return meta, encoded


def write_sidecar(path: Path, meta: dict) -> None:
    """One compact line in underfit's field order (a 10-minute file has a 6459-entry mask)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(meta, ensure_ascii=False) + "\n", encoding="utf-8")


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
