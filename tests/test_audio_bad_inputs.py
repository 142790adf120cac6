"""Every kind of bad input ends in quarantine with its own reason; the rest still completes."""

import io
import os

import numpy as np
import pytest
import soundfile as sf

from sa3mlx.audio import reasons
from sa3mlx.audio.normalize import LATENT_SAMPLES, normalize_listing
from sa3mlx.audio.scan import scan

RATE = 44100


def noise(frames, channels=2, seed=0):
    return (np.random.default_rng(seed).standard_normal((frames, channels)) * 0.1).astype(np.float32)


def encoded(fmt, subtype, frames=RATE):
    buffer = io.BytesIO()
    sf.write(buffer, noise(frames), RATE, format=fmt, subtype=subtype)
    return buffer.getvalue()


def garbage(n, seed=7):
    return np.random.default_rng(seed).bytes(n)


def build_bad_tree(root):
    """One file per bad-input kind (plus good ones); returns {name: expected reason}."""
    root.mkdir()
    sf.write(root / "good.wav", noise(RATE), RATE, subtype="PCM_16")
    sf.write(root / "silent.wav", np.zeros((RATE, 2), np.float32), RATE, subtype="PCM_16")
    expected = {}

    def put(name, data, reason):
        (root / name).write_bytes(data)
        expected[name] = reason

    put("zero_bytes.wav", b"", reasons.EMPTY_FILE)
    for fmt, subtype, ext in (("WAV", "PCM_16", "wav"), ("FLAC", "PCM_16", "flac"), ("OGG", "VORBIS", "ogg")):
        whole = encoded(fmt, subtype)
        put(f"truncated.{ext}", whole[: len(whole) // 2], reasons.TRUNCATED)
    put("text_renamed.wav", b"These are my notes about the session, not audio.\n" * 20, reasons.TEXT_FILE)
    put("random_bytes.flac", garbage(20000), reasons.UNKNOWN_FORMAT)
    for magic, ext in ((b"OggS", "ogg"), (b"fLaC", "flac"), (b"RIFF", "wav")):
        put(f"magic_then_garbage.{ext}", magic + garbage(20000), reasons.CORRUPT_HEADER)
    mp4_header = b"\x00\x00\x00\x20ftypM4A \x00\x00\x02\x00M4A isomiso2\x00\x00\x00\x08free"
    put("itunes.m4a", mp4_header + garbage(5000), reasons.UNSUPPORTED_CONTAINER)

    def put_audio(name, audio, rate, reason, subtype="PCM_16"):
        sf.write(root / name, audio, rate, subtype=subtype)
        expected[name] = reason

    with_nan = noise(RATE)
    with_nan[100, 0] = np.nan
    put_audio("nan_samples.wav", with_nan, RATE, reasons.NAN_SAMPLES, "FLOAT")
    with_inf = noise(RATE)
    with_inf[200, 1] = np.inf
    put_audio("inf_samples.wav", with_inf, RATE, reasons.INF_SAMPLES, "FLOAT")
    put_audio("rate_1hz.wav", noise(RATE), 1, reasons.ABSURD_SAMPLE_RATE)
    put_audio("zero_frames.wav", noise(0), RATE, reasons.ZERO_FRAMES)
    # 4400 frames at 48 kHz: more than a latent at the source rate, 4042 after resampling
    put_audio("too_short.wav", noise(4400), 48000, reasons.TOO_SHORT)

    (root / "folder.wav").mkdir()
    sf.write(root / "folder.wav" / "inside.wav", noise(RATE, seed=3), RATE, subtype="PCM_16")
    expected["folder.wav"] = reasons.DIRECTORY
    os.symlink(root / "no_such_target.wav", root / "dangling.wav")
    expected["dangling.wav"] = reasons.DANGLING_SYMLINK
    sf.write(root / "vanishing.wav", noise(RATE, seed=4), RATE, subtype="PCM_16")
    expected["vanishing.wav"] = reasons.VANISHED
    if os.geteuid() != 0:  # root reads anything
        sf.write(root / "unreadable.wav", noise(RATE, seed=5), RATE, subtype="PCM_16")
        os.chmod(root / "unreadable.wav", 0)
        expected["unreadable.wav"] = reasons.UNREADABLE
    return expected


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad")
    expected = build_bad_tree(base / "raw")
    listing = scan(base / "raw")
    os.unlink(base / "raw" / "vanishing.wav")  # gone between listing and reading
    report = normalize_listing(listing, base / "raw", base / "out")
    by_path = {q["path"]: q for q in report["quarantined"]}
    return report, expected, by_path


R = reasons
# (kind of bad input named in the issue, file in the tree, expected reason)
KINDS = [
    ("zero-byte file", "zero_bytes.wav", R.EMPTY_FILE),
    ("truncated file", "truncated.wav", R.TRUNCATED),
    ("truncated file", "truncated.flac", R.TRUNCATED),
    ("truncated file", "truncated.ogg", R.TRUNCATED),
    ("text renamed .wav", "text_renamed.wav", R.TEXT_FILE),
    ("random bytes .flac", "random_bytes.flac", R.UNKNOWN_FORMAT),
    ("garbage after a valid magic header", "magic_then_garbage.ogg", R.CORRUPT_HEADER),
    ("garbage after a valid magic header", "magic_then_garbage.flac", R.CORRUPT_HEADER),
    ("garbage after a valid magic header", "magic_then_garbage.wav", R.CORRUPT_HEADER),
    ("NaN samples", "nan_samples.wav", R.NAN_SAMPLES),
    ("Inf samples", "inf_samples.wav", R.INF_SAMPLES),
    ("absurd sample rate", "rate_1hz.wav", R.ABSURD_SAMPLE_RATE),
    ("zero frames", "zero_frames.wav", R.ZERO_FRAMES),
    ("shorter than one latent after resampling", "too_short.wav", R.TOO_SHORT),
    ("undecodable container", "itunes.m4a", R.UNSUPPORTED_CONTAINER),
    ("directory named like audio", "folder.wav", R.DIRECTORY),
    ("dangling symlink", "dangling.wav", R.DANGLING_SYMLINK),
    ("vanished during the run", "vanishing.wav", R.VANISHED),
    pytest.param(
        "unreadable file",
        "unreadable.wav",
        R.UNREADABLE,
        marks=pytest.mark.skipif(os.geteuid() == 0, reason="root can read a chmod-000 file"),
    ),
]


@pytest.mark.parametrize("kind, name, reason", KINDS)
def test_each_bad_input_is_quarantined_with_its_reason(bad_run, kind, name, reason):
    report, expected, by_path = bad_run
    assert expected[name] == reason  # the table matches the files the tree builder wrote
    assert by_path[name]["reason"] == reason, by_path[name]
    assert by_path[name]["detail"]
    assert reason in reasons.MEANING


def test_the_fifteen_kinds_have_distinct_reasons():
    by_kind = {}
    for row in KINDS:
        kind, _, reason = row.values if hasattr(row, "values") else row
        by_kind.setdefault(kind, set()).add(reason)
    assert len(by_kind) == 15
    assert all(len(found) == 1 for found in by_kind.values())
    assert len({found.pop() for found in by_kind.values()}) == 15


def test_permission_denied_is_unreadable_even_as_root(tmp_path, monkeypatch):
    from sa3mlx.audio import decode as decode_module

    raw = tmp_path / "raw"
    raw.mkdir()
    sf.write(raw / "locked.wav", noise(RATE), RATE, subtype="PCM_16")
    sf.write(raw / "ok.wav", noise(RATE, seed=1), RATE, subtype="PCM_16")

    def deny(path, *args, **kwargs):
        if str(path).endswith("locked.wav"):
            raise PermissionError(13, "Permission denied", str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(decode_module, "open", deny, raising=False)
    report = normalize_listing(scan(raw), raw, tmp_path / "out")
    assert [(q["path"], q["reason"]) for q in report["quarantined"]] == [("locked.wav", reasons.UNREADABLE)]
    assert report["counts"]["kept"] == 1


def test_the_rest_completes_and_silence_is_kept_and_flagged(bad_run):
    report, expected, by_path = bad_run
    outputs = {f["output"] for f in report["files"]}
    assert outputs == {"good.wav", "silent.wav", "folder.wav/inside.wav"}
    assert report["silent"] == ["silent.wav"]
    assert report["counts"]["silent"] == 1
    assert set(by_path) == set(expected)
    assert report["counts"]["quarantined"] == len(expected)


def test_too_short_means_after_resampling(bad_run):
    _, _, by_path = bad_run
    assert "4042 samples" in by_path["too_short.wav"]["detail"]
    assert 4400 > LATENT_SAMPLES


def test_non_utf8_file_name_is_reported_with_the_fix(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    sf.write(raw / "ok.wav", noise(RATE), RATE, subtype="PCM_16")
    try:
        sf.write(os.path.join(os.fsencode(raw), b"caf\xe9.wav"), noise(RATE), RATE, subtype="PCM_16")
    except OSError:
        pytest.skip("this filesystem refuses non-UTF-8 names")
    report = normalize_listing(scan(raw), raw, tmp_path / "out")
    [entry] = report["quarantined"]
    assert entry["path"] == "caf\\xe9.wav"
    assert entry["reason"] == reasons.NON_UTF8_NAME
    assert "rename" in entry["detail"] and "café.wav" in entry["detail"]
    assert [f["output"] for f in report["files"]] == ["ok.wav"]
