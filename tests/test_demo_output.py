"""Demo outputs: MP3s that decode to their exact length, peak normalisation, mel spectrogram
pictures and the index page."""

import json

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from sa3mlx.sample.audio_out import (
    ENCODER_DELAY,
    SAMPLES_PER_FRAME,
    crc16,
    encode_mp3,
    frame_offsets,
    read_audio_length,
    to_int16,
    write_mp3,
    write_sidecar,
)
from sa3mlx.sample.demo_entries import DemoEntry, parse_stem
from sa3mlx.sample.pictures import N_MELS, PIXELS_PER_MEL, mel_db, mel_filterbank, write_spectrogram
from sa3mlx.sample.report import SPECTROGRAM_DIR, write_index

RATE = 44100


def tone(seconds, channels=2, hz=440.0):
    t = np.arange(int(round(seconds * RATE))) / RATE
    return np.stack([np.sin(2 * np.pi * hz * t) * (0.5 + 0.5 * c) for c in range(channels)])


def test_peak_normalised_int16():
    pcm = to_int16(0.01 * tone(0.1))
    assert pcm.shape == (4410, 2) and pcm.dtype == np.int16 and np.abs(pcm).max() == 32767
    assert not to_int16(np.zeros((2, 10))).any()


@pytest.mark.parametrize("seconds,channels", [(9.0, 2), (2.37, 2), (0.013, 2), (1.0, 1)])
def test_mp3_decodes_to_the_exact_length_and_aligned(tmp_path, seconds, channels):
    pcm = to_int16(tone(seconds, channels))
    path = write_mp3(tmp_path / "a.mp3", pcm, RATE)
    assert read_audio_length(path) == (pcm.shape[0], RATE)
    decoded, _ = sf.read(path, dtype="int16", always_2d=True)
    assert decoded.shape == pcm.shape
    if pcm.shape[0] > 4096:  # no encoder-delay offset: the decoded tone lines up with the input
        assert np.corrcoef(decoded[:, 0].astype(float), pcm[:, 0].astype(float))[0, 1] > 0.99


def test_info_frame_counts_frames_and_bytes():
    pcm = to_int16(tone(3.0))
    data = encode_mp3(pcm, RATE)
    offsets = frame_offsets(data)
    assert data[36:40] == b"Xing"
    frames, total = int.from_bytes(data[44:48], "big"), int.from_bytes(data[48:52], "big")
    assert frames == len(offsets) - 1 and total == len(data)
    delays = int.from_bytes(data[36 + 120 + 21 : 36 + 120 + 24], "big")
    assert delays >> 12 == ENCODER_DELAY
    assert frames * SAMPLES_PER_FRAME == ENCODER_DELAY + pcm.shape[0] + (delays & 0xFFF)
    tag_crc = int.from_bytes(data[36 + 120 + 34 : 36 + 120 + 36], "big")
    assert tag_crc == crc16(data[:190])


def test_mel_filterbank_and_a_tone_lands_in_its_band():
    bank = mel_filterbank(RATE)
    assert bank.shape == (N_MELS, 1025) and (bank >= 0).all() and (bank.sum(axis=1) > 0).all()
    low, high = mel_db(tone(1.0, hz=300.0), RATE), mel_db(tone(1.0, hz=5000.0), RATE)
    assert low.mean(axis=1).argmax() < high.mean(axis=1).argmax()
    assert low.max() == 0.0 and low.min() >= -80.0


def test_spectrogram_png(tmp_path):
    path = write_spectrogram(tmp_path / "s.png", tone(2.0), RATE)
    image = Image.open(path)
    assert image.format == "PNG" and image.mode == "RGB"
    assert image.size[1] == N_MELS * PIXELS_PER_MEL and 100 < image.size[0] <= 1200


def test_stems():
    assert parse_stem("demo_3_00000120") == (3, 120) and parse_stem("baseline_2") == (2, None)
    assert parse_stem("loss_by_timestep") is None


def test_index_shows_baseline_beside_each_step(tmp_path):
    entries = [
        DemoEntry.from_dict({"prompt": "<b>drums</b> & bass", "seconds": 4}),
        DemoEntry.from_dict({"prompt": "pad", "arc": True}),
    ]
    for stem, index, baseline in (
        ("baseline_0", 0, True),
        ("demo_0_00000000", 0, False),
        ("demo_0_00000200", 0, False),
        ("demo_1_00000200", 1, False),
    ):
        (tmp_path / f"{stem}.mp3").write_bytes(b"")
        (tmp_path / SPECTROGRAM_DIR).mkdir(exist_ok=True)
        write_sidecar(tmp_path / f"{stem}.json", entries[index].sidecar(baseline))
    (tmp_path / "demo_1_00000300.json").write_text(json.dumps({"prompt": "unfinished"}))  # no mp3 yet
    page = write_index(tmp_path, entries, {1: "ARC demo skipped: shapes differ"}).read_text()
    assert "&lt;b&gt;drums&lt;/b&gt; &amp; bass" in page and "<b>drums" not in page
    order = [page.index(f'src="{s}.mp3"') for s in ("baseline_0", "demo_0_00000000", "demo_0_00000200")]
    assert order == sorted(order)
    assert "demo_1_00000300" not in page and "ARC demo skipped: shapes differ" in page
    assert f'src="{SPECTROGRAM_DIR}/demo_1_00000200.png"' in page
