"""Generate a small, deterministic demo dataset of musical clips in data/raw/.

The clips imitate what a user really drops into data/raw/ so that the normalize
stage gets exercised on a messy input: WAV (PCM_16, PCM_24, FLOAT), FLAC (16 and
24 bit), OGG Vorbis and MP3; sample rates 22050, 44100 and 48000; mono and
stereo; files in subfolders; tags as <stem>.json and <stem>.txt sidecars, as
sidecars in sibling ../json/ and ../txt/ folders, as ID3 and Vorbis comments
embedded in the files, and one file with no tags at all; plus one exact
duplicate (the same PCM stored as WAV and as FLAC under another name).

All audio is synthesised with a seeded numpy generator and every tag uses only
words from tools/demo_vocab.txt (plus digits). Re-running reproduces every
file byte for byte.

    python tools/make_demo_audio.py [--out data/raw] [--seed 0]
"""

import argparse
import json
import zlib
from pathlib import Path

import lameenc
import numpy as np
import soundfile as sf
from demo_synth import (
    clip_ambient,
    clip_arp_lead,
    clip_bass_line,
    clip_dub_chords,
    clip_funk_groove,
    clip_house_drums,
    clip_lofi_melody,
    clip_piano_chords,
)
from mutagen.flac import FLAC
from mutagen.id3 import ID3, TALB, TBPM, TCOM, TCON, TDRC, TIT2, TPE1, TPUB
from mutagen.oggvorbis import OggVorbis

REPO = Path(__file__).resolve().parent.parent
VOCAB_FILE = Path(__file__).resolve().parent / "demo_vocab.txt"
OWNED_SUFFIXES = {".wav", ".flac", ".ogg", ".mp3", ".json", ".txt"}


# ------------------------------------------------------------------ writing


def normalize(x, peak_db):
    return x * (10.0 ** (peak_db / 20.0) / np.max(np.abs(x)))


def to_int16(x):
    return np.clip(np.round(x * 32767.0), -32768, 32767).astype(np.int16)


def to_int24_in_int32(x):
    # libsndfile keeps the top 24 bits when it writes int32 data as PCM_24
    return np.clip(np.round(x * 8388607.0), -8388608, 8388607).astype(np.int32) << 8


def write_pcm(path, x, rate, fmt, subtype):
    if subtype == "PCM_16":
        data = to_int16(x)
    elif subtype == "PCM_24":
        data = to_int24_in_int32(x)
    else:
        data = x.astype(np.float32)
    sf.write(path, data, rate, format=fmt, subtype=subtype)
    if fmt == "WAV" and subtype == "FLOAT":
        zero_peak_timestamp(path)


def zero_peak_timestamp(path):
    """libsndfile stamps time(NULL) into the PEAK chunk of float WAVs; pin it to 0."""
    data = bytearray(path.read_bytes())
    pos = 12
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        if data[pos : pos + 4] == b"PEAK":
            data[pos + 12 : pos + 16] = bytes(4)
        pos += 8 + size + (size & 1)
    path.write_bytes(bytes(data))


def write_ogg(path, x, rate, tags=None):
    sf.write(path, x.astype(np.float32), rate, format="OGG", subtype="VORBIS")
    if tags:
        set_vorbis_comments(OggVorbis(path), tags)
    pin_ogg_serial(path, zlib.crc32(path.name.encode()))


def write_mp3(path, x, rate, tags):
    encoder = lameenc.Encoder()
    encoder.set_in_sample_rate(rate)
    encoder.set_channels(x.shape[1] if x.ndim == 2 else 1)
    # CBR: lameenc writes no Xing header, so VBR lengths get misread (libsndfile truncates them)
    encoder.set_bit_rate(192)
    encoder.set_quality(2)
    mp3 = encoder.encode(to_int16(x).tobytes()) + encoder.flush()
    path.write_bytes(bytes(mp3))
    id3 = ID3()
    for frame, key in (
        (TIT2, "title"),
        (TPE1, "artist"),
        (TALB, "album"),
        (TCON, "genre"),
        (TDRC, "date"),
        (TBPM, "bpm"),
        (TCOM, "composer"),
        (TPUB, "label"),
    ):
        if key in tags:
            id3.add(frame(encoding=3, text=[str(tags[key])]))
    id3.save(path)


def set_vorbis_comments(audio, tags):
    for key, value in tags.items():
        audio[key] = str(value)
    audio.save()


def ogg_crc_table():
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
        table.append(crc & 0xFFFFFFFF)
    return table


OGG_CRC_TABLE = ogg_crc_table()


def ogg_crc(data):
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ OGG_CRC_TABLE[(crc >> 24) ^ byte]
    return crc


def pin_ogg_serial(path, serial):
    """libsndfile picks a clock-seeded Ogg stream serial; overwrite it on every page."""
    data = bytearray(path.read_bytes())
    pos = 0
    while pos < len(data):
        if data[pos : pos + 4] != b"OggS":
            raise ValueError(f"{path}: no Ogg page at byte {pos}")
        segments = data[pos + 26]
        end = pos + 27 + segments + sum(data[pos + 27 : pos + 27 + segments])
        data[pos + 14 : pos + 18] = serial.to_bytes(4, "little")
        data[pos + 22 : pos + 26] = bytes(4)
        data[pos + 22 : pos + 26] = ogg_crc(data[pos:end]).to_bytes(4, "little")
        pos = end
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- the set


COMMON = {"artist": "deep keys", "album": "synthetic music", "date": "2024", "composer": "unknown", "label": "demo"}

# path, synth, rate, format, subtype, peak dBFS, embedded tags, sidecars {path: text or json}, lossless copy
CLIPS = [
    (
        "loops/four_on_the_floor.wav",
        clip_house_drums,
        44100,
        "WAV",
        "PCM_16",
        -1.0,
        None,
        {"loops/four_on_the_floor.txt": "house drums loop with four on the floor kick and hihat at 124 bpm"},
        None,
    ),
    (
        "bass_line.wav",
        clip_bass_line,
        22050,
        "WAV",
        "PCM_16",
        -2.0,
        None,
        {
            "bass_line.json": {
                "prompt": "deep dark bassline in a minor",
                "genre": "techno",
                "bpm": 110,
                "key": "a minor",
            }
        },
        "exports/bass_line_copy.flac",
    ),  # the exact duplicate, and the one file with no tags
    (
        "chords/warm_piano_chords.flac",
        clip_piano_chords,
        48000,
        "FLAC",
        "PCM_24",
        -1.5,
        dict(COMMON, title="warm piano chords", genre="jazz", bpm="90"),
        {},
        None,
    ),
    (
        "ambient_sweep.ogg",
        clip_ambient,
        44100,
        "OGG",
        "VORBIS",
        -3.0,
        dict(COMMON, title="dreamy ambient pad with noise sweep", genre="ambient", bpm="60"),
        {},
        None,
    ),
    (
        "funk_groove.mp3",
        clip_funk_groove,
        44100,
        "MP3",
        "MPEG_LAYER_III",
        -3.0,
        dict(COMMON, title="groovy funk house", genre="funk", bpm="118"),
        {},
        None,
    ),
    (
        "set2/audio/arp_lead.wav",
        clip_arp_lead,
        48000,
        "WAV",
        "FLOAT",
        -2.5,
        None,
        {
            "set2/json/arp_lead.json": {
                "prompt": "bright synth arpeggio lead in a minor",
                "genre": "electronic",
                "bpm": "128",
                "tags": ["arp", "pluck", "lead"],
            }
        },
        None,
    ),
    (
        "set2/audio/dub_chords.wav",
        clip_dub_chords,
        48000,
        "WAV",
        "PCM_24",
        -1.0,
        None,
        {"set2/txt/dub_chords.txt": "minimal dub techno chord loop in d minor at 120 bpm"},
        None,
    ),
    (
        "melody/lofi_keys.ogg",
        clip_lofi_melody,
        22050,
        "OGG",
        "VORBIS",
        -2.0,
        None,
        {"melody/lofi_keys.json": {"prompt": "mellow lofi piano melody", "genre": "lofi", "bpm": "80", "mood": "calm"}},
        None,
    ),
]


def load_vocab():
    lines = VOCAB_FILE.read_text(encoding="utf-8").splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def tag_words(value):
    if isinstance(value, dict):
        return [w for v in value.values() for w in tag_words(v)]
    if isinstance(value, list):
        return [w for v in value for w in tag_words(v)]
    return str(value).split()


def check_vocab():
    vocab = load_vocab()
    for path, _, _, _, _, _, embedded, sidecars, _ in CLIPS:
        for word in tag_words([embedded or {}, list(sidecars.values())]):
            if not (word in vocab or word.isdigit()):
                raise SystemExit(f"{path}: tag word {word!r} is not in {VOCAB_FILE.name}")


def write_audio(path, x, rate, fmt, subtype, embedded):
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "MP3":
        write_mp3(path, x, rate, embedded or {})
    elif fmt == "OGG":
        write_ogg(path, x, rate, embedded)
    else:
        write_pcm(path, x, rate, fmt, subtype)
        if embedded:
            set_vorbis_comments(FLAC(path), embedded)


def write_sidecar(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content, indent=2)
    path.write_text(text + "\n", encoding="utf-8")


def build(out, seed):
    """Render and write every clip; returns the written paths."""
    written = []
    for index, (name, synth, rate, fmt, subtype, peak_db, embedded, sidecars, copy) in enumerate(CLIPS):
        x = normalize(synth(rate, np.random.default_rng([seed, index])), peak_db)
        write_audio(out / name, x, rate, fmt, subtype, embedded)
        written.append(out / name)
        for sidecar, content in sidecars.items():
            write_sidecar(out / sidecar, content)
            written.append(out / sidecar)
        if copy:
            write_audio(out / copy, x, rate, Path(copy).suffix[1:].upper(), subtype, None)
            written.append(out / copy)
    return sorted(written)


def clear(out):
    """Remove the audio and sidecar files a previous run left, then empty folders."""
    if out == REPO or out in REPO.parents:
        raise SystemExit(f"refusing to clear {out}: it contains the repository")
    if not out.exists():
        return
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.suffix.lower() in OWNED_SUFFIXES:
            path.unlink()
    for path in sorted(out.rglob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def summary(out, paths):
    rows = [("file", "format", "subtype", "rate", "ch", "seconds", "bytes")]
    total = 0
    for path in paths:
        size = path.stat().st_size
        total += size
        name = str(path.relative_to(out))
        if path.suffix.lower() in (".json", ".txt"):
            rows.append((name, "sidecar", "", "", "", "", str(size)))
            continue
        info = sf.info(path)
        rows.append(
            (
                name,
                info.format,
                info.subtype,
                str(info.samplerate),
                str(info.channels),
                f"{info.frames / info.samplerate:.2f}",
                str(size),
            )
        )
    rows.append(("total", "", "", "", "", "", str(total)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "data" / "raw", help="output folder (cleared first)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the synthesis")
    args = parser.parse_args()
    out = args.out.resolve()
    check_vocab()
    clear(out)
    out.mkdir(parents=True, exist_ok=True)
    summary(out, build(out, args.seed))


if __name__ == "__main__":
    main()
