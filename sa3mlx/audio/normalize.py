"""The `normalize` stage's work: data/raw/ -> data/normalized/ (audio, tag sidecars, census).

For each audio-named input, in sorted order: decode (bad input -> quarantine with a reason),
first two channels (or a downmix), resample to 44.1 kHz with soxr, mono -> stereo, cap at
`max_seconds` aligned down to whole latents, drop exact duplicates, write the audio and a
`<stem>.json` of its tags. Nothing but the listed bad input stops the rest; outputs are
written atomically and are byte-identical for identical inputs.
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
from sa3mlx.runtime.io import remove_stale, save_json
from sa3mlx.runtime.layout import SAMPLE_RATE
from sa3mlx.runtime.params import dataclass_from_params
from sa3mlx.runtime.schema import choice, integer, number, positive, spec

LATENT_SAMPLES = 4096  # audio samples per SAME latent frame (SA3's codecs downsample by 4096)
REPORT_NAME = "report.json"


@dataclass(frozen=True)
class Options:
    sample_rate: int = field(default=44100, metadata=spec(integer(1)))
    max_seconds: float = field(default=600.0, metadata=spec(positive()))
    format: str = field(default="wav", metadata=spec(choice(FORMATS)))  # "wav": float32 WAV; "flac": 24-bit FLAC
    channels: str = field(default="first_two", metadata=spec(choice(POLICIES)))  # for >2 channels
    resample_quality: str = field(default="VHQ", metadata=spec(choice(QUALITIES)))
    silence_dbfs: float = field(default=-80.0, metadata=spec(number(high=0)))  # a peak at or below: silent (kept)
    strict: bool = False  # fail the stage if anything is quarantined

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


def normalize_dir(raw: str | os.PathLike, out: str | os.PathLike, options: Options = Options()) -> dict:
    """List `raw`, normalise every input into `out`, write and return the census report."""
    return normalize_listing(scan(raw), raw, out, options)


def normalize_listing(
    listing: Listing, raw: str | os.PathLike, out: str | os.PathLike, options: Options = Options()
) -> dict:
    raw, out = Path(raw), Path(out)
    _check_folders(raw, out)
    stems = output_stems(listing.inputs)
    extension = FORMATS[options.format]
    dedup = Deduplicator()
    decoded, quarantined = [], [_bad_name_entry(name) for name in listing.bad_names]
    written = {REPORT_NAME}
    for rel in listing.inputs:
        try:
            audio, record, tags = _prepare(raw, rel, options)
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
        name = stems[rel] + extension
        record["output"] = name
        clipped = write_audio(out / name, audio, options.sample_rate, options.format)
        if clipped:
            record["clipped_samples"] = clipped
        save_json(out / f"{stems[rel]}.json", tags)
        written.update({name, f"{stems[rel]}.json"})
        decoded.append(record)
    remove_stale(out, written)
    report = census.build_report(
        asdict(options), len(listing.inputs), decoded, quarantined, dedup.duplicates, listing.ignored
    )
    save_json(out / REPORT_NAME, report)
    return report


def stage_failure(report: dict, strict: bool) -> str | None:
    """Why the stage must exit non-zero, or None."""
    counts = report["counts"]
    if counts["kept"] == 0:
        return f"nothing usable: 0 of {counts['audio_files']} audio files kept"
    if strict and counts["quarantined"]:
        return f"normalize.strict is true and {counts['quarantined']} inputs were quarantined"
    return None


def _prepare(raw: Path, rel: str, options: Options) -> tuple[np.ndarray, dict, dict]:
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
    }
    if tags.warnings:
        record["tag_warnings"] = tags.warnings
    return audio, record, tags.values


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
