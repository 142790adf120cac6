"""Opening and decoding one input with libsndfile; every failure becomes a `Rejected` reason."""

from __future__ import annotations

import contextlib
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf

from sa3mlx.audio import reasons, sniff
from sa3mlx.audio.reasons import Rejected

MIN_SAMPLE_RATE = 2000
MAX_SAMPLE_RATE = 768000
BLOCK_FRAMES = 1 << 16
# libsndfile's MP3 frame count is an estimate from the bit rate; the others are exact
ESTIMATED_LENGTH_FORMATS = {"MP3"}


@dataclass
class Source:
    audio: np.ndarray  # (frames, channels) float32 at the source rate, at most the frames asked for
    sample_rate: int
    format: str  # libsndfile major format, e.g. "WAV", "FLAC", "OGG", "MP3"
    subtype: str  # e.g. "PCM_16", "VORBIS"
    frames: int  # length of the whole source (exact, or MP3's estimate when it was not all read)

    @property
    def channels(self) -> int:
        return self.audio.shape[1]

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


@contextlib.contextmanager
def open_input(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    """Open a listed input for reading: (file object, size); filesystem problems are Rejected."""
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        raise Rejected(reasons.VANISHED, "listed, then gone before it could be read") from None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        target = os.readlink(path) if stat.S_ISLNK(link.st_mode) else "?"
        raise Rejected(reasons.DANGLING_SYMLINK, f"points to {target!r}, which does not exist") from None
    if stat.S_ISDIR(st.st_mode):
        raise Rejected(reasons.DIRECTORY, "a directory, not a file (its contents are read as usual)")
    if not stat.S_ISREG(st.st_mode):
        raise Rejected(reasons.NOT_A_FILE, "a pipe, socket or device: not read")
    try:
        f = open(path, "rb")
    except PermissionError as e:
        raise Rejected(reasons.UNREADABLE, f"permission denied ({e.strerror}); fix with chmod") from None
    except FileNotFoundError:
        raise Rejected(reasons.VANISHED, "listed, then gone before it could be read") from None
    except IsADirectoryError:
        raise Rejected(reasons.DIRECTORY, "a directory, not a file") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise Rejected(reasons.EMPTY_FILE, "0 bytes")
        yield f, size


def decode(f: BinaryIO, size: int, max_seconds: float | None = None) -> Source:
    """Decode to float32 (frames, channels); read at most `max_seconds` (+0.1 s) of it."""
    f.seek(0)
    head = f.read(sniff.HEAD_BYTES)
    f.seek(0)
    try:
        sound = sf.SoundFile(f)
    except Exception as e:  # libsndfile's open errors: LibsndfileError, RuntimeError, TypeError
        raise _explain_open_failure(head, e) from None
    with sound:
        rate, header_frames = sound.samplerate, sound.frames
        exact = sound.format not in ESTIMATED_LENGTH_FORMATS
        where = f"{sound.format} {sound.subtype}, {rate} Hz, {sound.channels} ch"
        if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
            raise Rejected(
                reasons.ABSURD_SAMPLE_RATE,
                f"{rate} Hz in the header (accepted {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}); {where}",
            )
        cut = _container_truncation(f, size, head)
        if cut:
            raise Rejected(reasons.TRUNCATED, f"{cut}; {where}")
        if exact and header_frames == 0:
            raise Rejected(reasons.ZERO_FRAMES, f"the header declares 0 frames; {where}")
        wanted = header_frames
        if max_seconds is not None:
            wanted = min(wanted, math.ceil(max_seconds * rate) + rate // 10)
        audio = _read_blocks(sound, wanted, header_frames, where)
        format_name, subtype = sound.format, sound.subtype
    if audio.shape[0] == 0:
        raise Rejected(reasons.ZERO_FRAMES, f"no audio frames could be decoded; {where}")
    if exact and audio.shape[0] < wanted:
        raise Rejected(reasons.TRUNCATED, f"decoded {audio.shape[0]} of the {wanted} frames expected; {where}")
    _check_finite(audio, where)
    # an MP3 read to its end knows its true length; a capped one only the estimate
    frames = header_frames if exact or audio.shape[0] >= wanted else audio.shape[0]
    return Source(audio=audio, sample_rate=rate, format=format_name, subtype=subtype, frames=frames)


def _read_blocks(sound: sf.SoundFile, wanted: int, total: int, where: str) -> np.ndarray:
    blocks, done = [], 0
    while done < wanted:
        try:
            block = sound.read(min(BLOCK_FRAMES, wanted - done), dtype="float32", always_2d=True)
        except Exception as e:
            raise Rejected(
                reasons.TRUNCATED, f"decoding stopped after {done} of {total} frames ({_message(e)}); {where}"
            ) from None
        if block.shape[0] == 0:
            break
        blocks.append(block)
        done += block.shape[0]
    if not blocks:
        return np.zeros((0, sound.channels), np.float32)
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def _check_finite(audio: np.ndarray, where: str) -> None:
    nan = int(np.count_nonzero(np.isnan(audio)))
    if nan:
        raise Rejected(reasons.NAN_SAMPLES, f"{nan} NaN samples; {where}")
    inf = int(np.count_nonzero(np.isinf(audio)))
    if inf:
        raise Rejected(reasons.INF_SAMPLES, f"{inf} infinite samples; {where}")


def _container_truncation(f: BinaryIO, size: int, head: bytes) -> str | None:
    return sniff.truncation(f.fileno(), size, sniff.signature(head))


def _explain_open_failure(head: bytes, error: Exception) -> Rejected:
    message = _message(error)
    kind = sniff.signature(head)
    if kind in sniff.UNDECODABLE_NAMES:
        return Rejected(
            reasons.UNSUPPORTED_CONTAINER,
            f"{sniff.UNDECODABLE_NAMES[kind]} cannot be decoded by libsndfile "
            f"{sf.__libsndfile_version__}; convert it to FLAC or WAV (e.g. with ffmpeg)",
        )
    if kind == "ogg" and sniff.ogg_codec(head):
        return Rejected(
            reasons.UNSUPPORTED_CONTAINER,
            f"an Ogg stream of {sniff.ogg_codec(head)}, which this libsndfile cannot decode ({message})",
        )
    if kind == "wav" and sniff.wav_codec(head) is not None:
        return Rejected(
            reasons.UNSUPPORTED_CONTAINER,
            f"a WAV file with codec tag 0x{sniff.wav_codec(head):04x}, which libsndfile cannot decode ({message})",
        )
    if kind is not None:
        return Rejected(
            reasons.CORRUPT_HEADER,
            f"starts with the {kind.upper()} signature {head[:4]!r} but is not a readable stream ({message})",
        )
    if sniff.looks_like_text(head):
        preview = head[:40].decode("utf-8", "replace").split("\n")[0]
        return Rejected(reasons.TEXT_FILE, f"text, not audio (starts {preview!r})")
    return Rejected(
        reasons.UNKNOWN_FORMAT, f"no known audio signature (first bytes {head[:8].hex()}); libsndfile: {message}"
    )


def _message(error: Exception) -> str:
    text = str(error)
    # soundfile prefixes "Error opening <file object repr>: "; the object repr is noise
    return text.split(": ", 1)[1] if text.startswith("Error opening") and ": " in text else text
