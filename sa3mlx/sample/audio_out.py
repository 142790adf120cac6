"""Demo audio files: peak-normalised int16 PCM to MP3 (LAME VBR, best quality, through `lameenc`)
and optional WAV, plus underfit's sidecar JSON, each written atomically.

LAME's streaming API (what `lameenc` exposes) cannot seek back to fill in the Xing/LAME info
frame that `lame` itself writes first, and without one a VBR file's length is only guessed
from its first frame (libsndfile then stops reading half-way). `info_frame` builds that frame
— frame count, byte count, seek table, encoder delay and padding — so decoders that read it
(mpg123, hence libsndfile/soundfile; browsers; ffmpeg) know the exact sample count.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import soundfile as sf

from sa3mlx.runtime.io import atomic_path

VBR_QUALITY = 0  # LAME -V 0, as underfit's `ffmpeg -q:a 0`
VBR_MTRH = 4  # LAME's default VBR algorithm
ALGORITHM_QUALITY = 2  # LAME -q 2 (the best non-exhaustive search)
SAMPLES_PER_FRAME = 1152  # MPEG-1 Layer III
ENCODER_DELAY = 576  # LAME's fixed encoder delay, stored in the info frame
INFO_BITRATE_INDEX = 9  # 128 kbit/s: 417 bytes at 44.1 kHz, room for the Xing + LAME tags
_BITRATES_KBPS = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_SAMPLE_RATES = (44100, 48000, 32000)
_TOC_ENTRIES = 100
_CRC_SPAN = 190  # the LAME tag CRC covers the info frame's first 190 bytes


def to_int16(audio: np.ndarray) -> np.ndarray:
    """[C, S] float -> [S, C] int16, peak-normalised (x / max|x| · 32767); silence (and NaN) stays 0."""
    audio = np.nan_to_num(np.asarray(audio, np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    scaled = audio / peak * 32767.0 if peak > 0 else audio
    return np.round(scaled).clip(-32768, 32767).astype(np.int16).T.copy()


def encode_mp3(pcm: np.ndarray, sample_rate: int) -> bytes:
    """[S, C] int16 -> MP3 bytes (VBR -V 0), led by an info frame with the exact length."""
    import lameenc

    encoder = lameenc.Encoder()
    encoder.set_in_sample_rate(sample_rate)
    encoder.set_channels(pcm.shape[1])
    encoder.set_quality(ALGORITHM_QUALITY)
    encoder.set_vbr(VBR_MTRH)
    encoder.set_vbr_quality(VBR_QUALITY)
    stream = bytes(encoder.encode(np.ascontiguousarray(pcm).tobytes()) + encoder.flush())
    return info_frame(stream, pcm.shape[0]) + stream


def _frame_header(data: bytes, pos: int) -> tuple[int, int] | None:
    """(frame length in bytes, sample rate) of an MPEG-1 Layer III frame at pos, else None."""
    if pos + 4 > len(data) or data[pos] != 0xFF or (data[pos + 1] & 0xFE) != 0xFA:
        return None
    bitrate_index, rate_index = data[pos + 2] >> 4, (data[pos + 2] >> 2) & 3
    if not 0 < bitrate_index < 15 or rate_index == 3:
        return None
    rate = _SAMPLE_RATES[rate_index]
    return 144000 * _BITRATES_KBPS[bitrate_index] // rate + ((data[pos + 2] >> 1) & 1), rate


def frame_offsets(stream: bytes) -> list[int]:
    """Byte offsets of the consecutive MPEG-1 Layer III frames from the start of stream."""
    offsets, pos = [], 0
    while (header := _frame_header(stream, pos)) is not None:
        offsets.append(pos)
        pos += header[0]
    return offsets


def crc16(data: bytes) -> int:
    """CRC-16/ARC (the LAME tag's checksum)."""
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0xA001 if crc & 1 else crc >> 1
    return crc


def info_frame(stream: bytes, samples: int) -> bytes:
    """A silent first frame carrying the Xing header (frames, bytes, TOC) and the LAME tag
    (encoder delay, end padding) for an MPEG-1 Layer III stream of `samples` per channel."""
    offsets = frame_offsets(stream)
    if not offsets:
        raise ValueError("no MPEG-1 Layer III frames in the encoder output")
    head = bytearray(stream[:4])
    head[2] = (INFO_BITRATE_INDEX << 4) | (head[2] & 0x0C)  # same rate; no padding, private bit 0
    size, _ = _frame_header(bytes(head), 0)
    mono = (head[3] >> 6) == 3
    side_info = 17 if mono else 32
    total_bytes = size + len(stream)
    toc = bytes(
        min(255, (size + offsets[len(offsets) * i // _TOC_ENTRIES]) * 256 // total_bytes) for i in range(_TOC_ENTRIES)
    )
    padding = len(offsets) * SAMPLES_PER_FRAME - ENCODER_DELAY - samples
    if not 0 <= padding < 4096:
        raise ValueError(f"{len(offsets)} frames cannot hold {samples} samples after the encoder delay")
    xing = b"Xing" + struct.pack(">IIII", 0x0F, len(offsets), total_bytes, 0)[:12] + toc + struct.pack(">I", 0)
    delays = (ENCODER_DELAY << 12 | padding).to_bytes(3, "big")
    lame = (
        b"LAME3.100"
        + bytes([0x04, 0])
        + bytes(8)
        + bytes([0, 0])
        + delays
        + bytes(4)
        + struct.pack(">I", total_bytes)
        + bytes(2)
    )
    frame = bytes(head) + bytes(side_info) + xing + lame
    frame += struct.pack(">H", crc16(frame[:_CRC_SPAN]))
    return frame + bytes(size - len(frame))


def write_mp3(path: str | Path, pcm: np.ndarray, sample_rate: int) -> Path:
    path = Path(path)
    data = encode_mp3(pcm, sample_rate)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        sf.write(tmp, pcm, sample_rate, subtype="PCM_16", format="WAV")
    return path


def write_sidecar(path: str | Path, record: dict) -> Path:
    """The demo's JSON, keys in underfit's order (written last: it marks the demo as done)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_audio_length(path: str | Path) -> tuple[int, int]:
    """(frames decoded to the end, sample rate) of an audio file."""
    with sf.SoundFile(str(path)) as sound:
        frames = 0
        while len(block := sound.read(1 << 16, dtype="int16")):
            frames += len(block)
        return frames, sound.samplerate
