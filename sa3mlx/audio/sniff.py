"""Recognising files by their first bytes, and container-level truncation checks.

Used only to explain a failure (libsndfile decides what it can decode) and to catch
truncation that libsndfile reads past silently (a WAV/AIFF cut short, an Ogg stream with
no final page).
"""

from __future__ import annotations

import codecs
import os

HEAD_BYTES = 4096
OGG_MAX_PAGE = 27 + 255 + 255 * 255

# signatures of formats libsndfile reads
DECODABLE = {"wav", "aiff", "flac", "ogg", "mp3", "caf", "au", "w64"}
# containers/codecs libsndfile does not read (none of them on any platform as of 1.2)
UNDECODABLE_NAMES = {
    "mp4": "MPEG-4 / M4A (AAC or ALAC)",
    "adts": "raw AAC (ADTS)",
    "asf": "ASF / WMA",
    "ape": "Monkey's Audio",
    "wavpack": "WavPack",
}
ASF_GUID = bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c")


def signature(head: bytes) -> str | None:
    """The container whose magic bytes `head` starts with, or None."""
    if head[:4] in (b"RIFF", b"RIFX", b"RF64"):
        return "wav"
    if head[:4] == b"FORM":
        return "aiff"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"caff":
        return "caf"
    if head[:4] == b".snd":
        return "au"
    if head[:4] == b"riff":
        return "w64"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head[:16] == ASF_GUID:
        return "asf"
    if head[:4] == b"MAC ":
        return "ape"
    if head[:4] == b"wvpk":
        return "wavpack"
    if head[:3] == b"ID3":
        return "mp3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:
        return "adts"  # sync word with MPEG layer bits 00
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        return "mp3"
    return None


def looks_like_text(head: bytes) -> bool:
    """No NUL bytes and valid UTF-8 (a multi-byte character may be cut at the end)."""
    if not head or b"\x00" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def ogg_codec(head: bytes) -> str | None:
    """The codec named in the first packet of an Ogg stream, if the first page is well formed."""
    if head[:4] != b"OggS" or len(head) < 28 or head[4] != 0:
        return None
    body = head[27 + head[26] :]
    for magic, name in (
        (b"\x01vorbis", "Vorbis"),
        (b"OpusHead", "Opus"),
        (b"\x7fFLAC", "FLAC"),
        (b"Speex   ", "Speex"),
        (b"\x80theora", "Theora video"),
    ):
        if body.startswith(magic):
            return name
    return None


def wav_codec(head: bytes) -> int | None:
    """The WAVE format tag, when the RIFF/WAVE/fmt structure is intact."""
    if head[:4] != b"RIFF" or head[8:16] != b"WAVE" + b"fmt " or len(head) < 22:
        return None
    return int.from_bytes(head[20:22], "little")


def truncation(fd: int, size: int, kind: str | None) -> str | None:
    """Why a container is cut short, or None. Reads with pread: the file offset is untouched
    (libsndfile may be reading the same descriptor)."""
    if kind in ("wav", "aiff"):
        return _chunked_truncation(fd, size, kind)
    if kind == "ogg":
        return _ogg_truncation(fd, size)
    return None


def _chunked_truncation(fd: int, size: int, kind: str) -> str | None:
    head = os.pread(fd, 8, 0)
    order = "big" if kind == "aiff" or head[:4] == b"RIFX" else "little"
    declared = int.from_bytes(head[4:8], order)
    if declared in (0, 0xFFFFFFFF) or head[:4] == b"RF64":
        return None  # size unknown (streamed writes) or in a 64-bit chunk
    missing = declared + 8 - size
    if missing > 1:  # one byte of slack: writers that omit the final pad byte
        return f"the {head[:4].decode()} header declares {declared + 8} bytes, the file has {size}"
    return None


def _ogg_truncation(fd: int, size: int) -> str | None:
    start = max(0, size - 2 * OGG_MAX_PAGE)
    tail = os.pread(fd, size - start, start)
    pos = tail.rfind(b"OggS")
    while pos >= 0:
        page = tail[pos:]
        if len(page) >= 27 and page[4] == 0 and page[5] <= 7:
            break
        pos = tail.rfind(b"OggS", 0, pos)
    if pos < 0:
        return "no Ogg page found near the end of the file"
    page = tail[pos:]
    segments = page[26]
    if len(page) < 27 + segments:
        return "the last Ogg page is cut short"
    end = 27 + segments + sum(page[27 : 27 + segments])
    if end > len(page):
        return f"the last Ogg page is cut short ({len(page)} of {end} bytes)"
    if end == len(page) and not page[5] & 4:
        return "the Ogg stream has no end-of-stream page"
    return None
