"""The `normalize` stage's work: data/raw/ -> data/normalized/ (audio, tag sidecars, census).

For each audio-named input, in sorted order: decode (bad input -> quarantine with a reason),
first two channels (or a downmix), resample to 44.1 kHz with soxr, mono -> stereo, cap at
`max_seconds` aligned down to whole latents, drop exact duplicates, write the audio and a
`<stem>.json` of its tags, one file each or packed in tar shards (`layout`, see
`sa3mlx/runtime/shards.py`). Nothing but the listed bad input stops the rest; outputs are
written atomically and are byte-identical for identical inputs.

An input whose bytes and audio settings match a file of the previous output (the version dvc.lock
records, read from the DVC cache: `sa3mlx/runtime/previous.py`) is not decoded again: its audio
member and census record are taken over (the tags are read afresh), so the outputs are
byte-identical to a full run.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sa3mlx.audio import census, reasons
from sa3mlx.audio.channels import POLICIES, reduce_channels, to_stereo
from sa3mlx.audio.decode import decode, open_input
from sa3mlx.audio.dedup import Deduplicator, pcm_hash
from sa3mlx.audio.naming import output_stems
from sa3mlx.audio.reasons import Rejected
from sa3mlx.audio.resample import QUALITIES, resample
from sa3mlx.audio.scan import Listing, scan
from sa3mlx.audio.tags import find_tags
from sa3mlx.audio.write import FORMATS, write_audio
from sa3mlx.runtime.errors import ParamError, reading
from sa3mlx.runtime.io import sha256_file
from sa3mlx.runtime.layout import SAMPLE_RATE
from sa3mlx.runtime.params import dataclass_from_params
from sa3mlx.runtime.previous import PreviousOutput
from sa3mlx.runtime.schema import choice, integer, number, positive, spec
from sa3mlx.runtime.shards import LAYOUTS, NORMALIZE_REPORT, TreeWriter, choose_layout

LATENT_SAMPLES = 4096  # audio samples per SAME latent frame (SA3's codecs downsample by 4096)
REPORT_NAME = NORMALIZE_REPORT
NORMALIZE_VERSION = 1  # in the report; a previous output of another version is not reused: bump when the audio changes
AUDIO_SETTINGS = ("sample_rate", "max_seconds", "format", "channels", "resample_quality", "silence_dbfs")


@dataclass(frozen=True)
class Options:
    sample_rate: int = field(default=44100, metadata=spec(integer(1)))
    max_seconds: float = field(default=600.0, metadata=spec(positive()))
    format: str = field(default="wav", metadata=spec(choice(FORMATS)))  # "wav": float32 WAV; "flac": 24-bit FLAC
    channels: str = field(default="first_two", metadata=spec(choice(POLICIES)))  # for >2 channels
    resample_quality: str = field(default="VHQ", metadata=spec(choice(QUALITIES)))
    silence_dbfs: float = field(default=-80.0, metadata=spec(number(high=0)))  # a peak at or below: silent (kept)
    strict: bool = False  # fail the stage if anything is quarantined
    layout: str = field(default="files", metadata=spec(choice(LAYOUTS)))  # files|shards|auto (runtime/shards.py)

    @classmethod
    def from_params(cls, params: dict) -> Options:
        options = dataclass_from_params(cls, params, "normalize")
        options.validate()
        return options

    def validate(self) -> None:
        if self.max_samples < LATENT_SAMPLES:
            raise ParamError("normalize.max_seconds", "shorter than one latent (4096 samples)", self.max_seconds)

    @property
    def max_samples(self) -> int:
        return int(self.max_seconds * self.sample_rate) // LATENT_SAMPLES * LATENT_SAMPLES


def normalize_dir(
    raw: str | os.PathLike,
    out: str | os.PathLike,
    options: Options = Options(),
    previous: PreviousOutput | None = None,
    log=None,
) -> dict:
    """List `raw`, normalise every input into `out`, write and return the census report."""
    return normalize_listing(scan(raw), raw, out, options, previous, log)


def normalize_listing(
    listing: Listing,
    raw: str | os.PathLike,
    out: str | os.PathLike,
    options: Options = Options(),
    previous: PreviousOutput | None = None,
    log=None,
) -> dict:
    """`previous`: an earlier output to take unchanged files from; `log`: gets one line on the reuse."""
    raw, out = Path(raw), Path(out)
    _check_folders(raw, out)
    stems = output_stems(listing.inputs)
    extension = FORMATS[options.format]
    reusable = Reusable(previous, options)
    writer = TreeWriter(out, choose_layout(options.layout, len(listing.inputs), "normalize.layout"))
    dedup = Deduplicator()
    decoded, quarantined = [], [_bad_name_entry(name) for name in listing.bad_names]
    for rel in listing.inputs:
        try:
            record, tags, audio = reusable.take(raw, rel) or _prepare(raw, rel, options)
        except Rejected as r:
            quarantined.append({"path": rel, "reason": r.reason, "detail": r.detail})
            continue
        except Exception as e:  # bad input never stops the stage
            quarantined.append({"path": rel, "reason": reasons.UNEXPECTED_ERROR, "detail": f"{type(e).__name__}: {e}"})
            continue
        kept = dedup.seen(record["sha256"], rel)
        if kept is not None:
            decoded.append({**record, "duplicate_of": kept})
            continue
        record["output"] = name = stems[rel] + extension
        _write_audio(writer, name, audio, record, options)
        writer.add_bytes(f"{stems[rel]}.json", _json_bytes(tags))
        decoded.append(record)
    report = census.build_report(
        asdict(options), len(listing.inputs), decoded, quarantined, dedup.duplicates, listing.ignored
    )
    report["version"] = NORMALIZE_VERSION
    report["duplicate_files"] = [r for r in decoded if "duplicate_of" in r]  # their records, for reuse
    writer.finish(REPORT_NAME, report)
    if log is not None:
        log(reusable.line(len(decoded)))
    return report


def _write_audio(writer: TreeWriter, name: str, audio, record: dict, options: Options) -> None:
    """Write freshly computed audio (an array) or take over a previous member (a Span)."""
    if not isinstance(audio, np.ndarray):
        writer.add_span(name, audio)
        return
    clipped = write_audio(writer.staging_path(name), audio, options.sample_rate, options.format)
    writer.add_staged(name)
    if clipped:
        record["clipped_samples"] = clipped


def _json_bytes(data) -> bytes:
    """What `save_json` writes."""
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


class Reusable:
    """The kept files of a previous output made with the same audio settings, by input sha256."""

    def __init__(self, previous: PreviousOutput | None, options: Options):
        self.previous, self.options = previous, options
        self.records: dict[str, dict] = {}
        self.outputs: dict[str, str] = {}  # source -> output of the kept files
        self.reused = 0
        report = previous.summary if previous is not None else None
        if isinstance(report, dict) and self._same_settings(report):
            for record in report.get("files", []) + report.get("duplicate_files", []):
                if "input_sha256" in record:
                    self.records.setdefault(record["input_sha256"], record)
                if "output" in record:
                    self.outputs[record["source"]] = record["output"]

    def _same_settings(self, report: dict) -> bool:
        settings = report.get("settings") or {}
        mine = asdict(self.options)
        return report.get("version") == NORMALIZE_VERSION and all(settings.get(k) == mine[k] for k in AUDIO_SETTINGS)

    def take(self, raw: Path, rel: str):
        """(record, tags, previous audio Span) when `rel`'s bytes were normalised before, else None."""
        if not self.records:
            return None
        with open_input(raw / rel) as (f, _):
            record = self.records.get(sha256_file(raw / rel))
            if record is None:
                return None
            # a duplicate's audio is that of the file it duplicated (the same PCM gives the same bytes)
            output = record.get("output") or self.outputs.get(record.get("duplicate_of"))
            span = self.previous.member(output) if output else None
            if span is None:
                return None
            tags = find_tags(raw / rel, raw, f)
        fresh = {k: v for k, v in record.items() if k not in ("output", "tags", "tag_warnings", "duplicate_of")}
        fresh.update(source=rel, tags=tags.source)
        if tags.warnings:
            fresh["tag_warnings"] = tags.warnings
        self.reused += 1
        return fresh, tags.values, span

    def line(self, decoded: int) -> str:
        damaged = self.previous.damaged if self.previous is not None else []
        note = f"; damaged in the DVC cache, recomputed: {', '.join(damaged)}" if damaged else ""
        return (
            f"normalize: {decoded - self.reused} decoded and resampled, {self.reused} unchanged taken from "
            f"the previous output{note}"
        )


def stage_failure(report: dict, strict: bool) -> str | None:
    """Why the stage must exit non-zero, or None."""
    counts = report["counts"]
    if counts["kept"] == 0:
        return f"nothing usable: 0 of {counts['audio_files']} audio files kept"
    if strict and counts["quarantined"]:
        return f"normalize.strict is true and {counts['quarantined']} inputs were quarantined"
    return None


def _prepare(raw: Path, rel: str, options: Options) -> tuple[dict, dict, np.ndarray]:
    path = raw / rel
    limit = options.max_samples / options.sample_rate
    with open_input(path) as (f, size):
        source = decode(f, size, limit)
        tags = find_tags(path, raw, f)
    audio = reduce_channels(source.audio, options.channels)
    audio = resample(audio, source.sample_rate, options.sample_rate, options.resample_quality)
    capped = audio.shape[0] > options.max_samples
    audio = to_stereo(audio[: options.max_samples])
    if audio.shape[0] < LATENT_SAMPLES:
        raise Rejected(
            reasons.TOO_SHORT,
            f"{audio.shape[0]} samples at {options.sample_rate} Hz after "
            f"resampling ({source.frames} at {source.sample_rate} Hz); "
            f"one latent is {LATENT_SAMPLES}",
        )
    peak = float(np.max(np.abs(audio)))
    record = {
        "source": rel,
        "format": source.format,
        "subtype": source.subtype,
        "sample_rate": source.sample_rate,
        "channels": source.channels,
        "source_seconds": round(source.seconds, 3),
        "samples": int(audio.shape[0]),
        "seconds": round(audio.shape[0] / options.sample_rate, 3),
        "capped": capped,
        "peak_dbfs": round(20 * math.log10(peak), 2) if peak > 0 else None,
        "silent": peak <= 10 ** (options.silence_dbfs / 20),
        "tags": tags.source,
        "sha256": pcm_hash(audio),
        "input_sha256": sha256_file(path),
    }
    if tags.warnings:
        record["tag_warnings"] = tags.warnings
    return record, tags.values, audio


def _bad_name_entry(bad: dict) -> dict:
    return {
        "path": bad["path"],
        "reason": reasons.NON_UTF8_NAME,
        "detail": f"rename it to valid UTF-8 (DVC fails on such names before any stage runs), "
        f"e.g. to {bad['suggested']!r}",
    }


def _check_folders(raw: Path, out: Path) -> None:
    raw_abs, out_abs = raw.resolve(), out.resolve()
    if out_abs == raw_abs or raw_abs in out_abs.parents or out_abs in raw_abs.parents:
        raise ValueError(f"output folder {out} must not contain or lie inside the input folder {raw}")


def check_codec_rate(sample_rate: int, model_config: str | os.PathLike, base: str) -> None:
    """normalize.sample_rate must be the rate of model.base's codec (its model_config.json), or every
    file would be rewritten only for encode to refuse it."""
    model_config = Path(model_config)
    with reading(model_config, "model config", fix=f"model.base '{base}' must name a complete model folder"):
        data = json.loads(model_config.read_text(encoding="utf-8"))
        codec_rate = int(data.get("sample_rate", SAMPLE_RATE))
    if sample_rate != codec_rate:
        raise ParamError(
            "normalize.sample_rate",
            f"the codec of model.base '{base}' takes {codec_rate} Hz ({model_config}): set {codec_rate}",
            sample_rate,
        )
