"""The normalize stage on the demo data and on small made-up folders; under DVC too."""

import filecmp
import json
import os
import runpy
import shutil
import subprocess
import sys

import mutagen
import numpy as np
import pytest
import soundfile as sf
import yaml
from conftest import ROOT
from mutagen.flac import FLAC

from sa3mlx.audio import reasons
from sa3mlx.audio.census import summary
from sa3mlx.audio.naming import output_stems
from sa3mlx.audio.normalize import LATENT_SAMPLES, REPORT_NAME, Options, normalize_dir

RAW = ROOT / "data" / "raw"
RATE = 44100


def noise(frames, channels=2, seed=0):
    return (np.random.default_rng(seed).standard_normal((frames, channels)) * 0.1).astype(np.float32)


def tree_files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "normalized"
    return normalize_dir(RAW, out), out


def test_demo_census(demo):
    report, out = demo
    assert report["counts"] == {
        "audio_files": 9,
        "decoded": 9,
        "kept": 8,
        "duplicates": 1,
        "quarantined": 0,
        "silent": 0,
        "capped": 0,
        "ignored": 0,
    }
    assert report["formats"] == {"FLAC": 2, "MP3": 1, "OGG": 2, "WAV": 4}
    assert report["encodings"] == {
        "FLAC PCM_16": 1,
        "FLAC PCM_24": 1,
        "MP3 MPEG_LAYER_III": 1,
        "OGG VORBIS": 2,
        "WAV FLOAT": 1,
        "WAV PCM_16": 2,
        "WAV PCM_24": 1,
    }
    assert report["sample_rates"] == {"22050": 3, "44100": 3, "48000": 3}
    assert report["channels"] == {"1": 4, "2": 5}
    assert report["durations"] == {"<10s": 5, "10-30s": 4}
    assert report["seconds_total"] == pytest.approx(90.436, abs=0.002)
    assert report["hours_total"] == pytest.approx(0.0251, abs=0.0001)
    [duplicate] = report["duplicates"]
    assert (duplicate["kept"], duplicate["removed"]) == ("bass_line.wav", "exports/bass_line_copy.flac")
    assert json.loads((out / REPORT_NAME).read_text()) == report
    text = summary(report, "data/raw", "data/normalized")
    assert "exports/bass_line_copy.flac = bass_line.wav" in text
    assert "formats      FLAC 2, MP3 1, OGG 2, WAV 4" in text


def test_demo_outputs_keep_relative_paths_with_a_json_next_to_each(demo):
    _, out = demo
    stems = [
        "ambient_sweep",
        "bass_line",
        "chords/warm_piano_chords",
        "funk_groove",
        "loops/four_on_the_floor",
        "melody/lofi_keys",
        "set2/audio/arp_lead",
        "set2/audio/dub_chords",
    ]
    assert tree_files(out) == sorted([REPORT_NAME] + [s + e for s in stems for e in (".json", ".wav")])
    assert json.loads((out / "loops/four_on_the_floor.json").read_text()) == {
        "prompt": "house drums loop with four on the floor kick and hihat at 124 bpm"
    }
    assert json.loads((out / "set2/audio/dub_chords.json").read_text()) == {
        "prompt": "minimal dub techno chord loop in d minor at 120 bpm"
    }


def test_demo_outputs_are_44k1_stereo_float_with_resampled_lengths(demo):
    report, out = demo
    for record in report["files"]:
        info = sf.info(out / record["output"])
        assert (info.samplerate, info.channels, info.subtype, info.format) == (RATE, 2, "FLOAT", "WAV")
        assert info.frames == record["samples"]
        if record["format"] != "MP3":  # soxr keeps the duration: frames * 44100 / rate, rounded
            source = sf.info(RAW / record["source"])
            assert abs(info.frames - source.frames * RATE / source.samplerate) <= 1
    audio, _ = sf.read(out / "bass_line.wav", dtype="float32")  # 22.05 kHz mono source
    np.testing.assert_array_equal(audio[:, 0], audio[:, 1])
    source, _ = sf.read(RAW / "loops" / "four_on_the_floor.wav", dtype="float32")  # 44.1 kHz stereo: untouched
    np.testing.assert_array_equal(sf.read(out / "loops" / "four_on_the_floor.wav", dtype="float32")[0], source)


def test_embedded_metadata_is_not_copied_into_the_audio(demo, tmp_path):
    _, out = demo
    data = (out / "funk_groove.wav").read_bytes()  # source has ID3 tags
    chunks, pos = [], 12
    while pos < len(data):
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        chunks.append(data[pos : pos + 4])
        pos += 8 + size + (size & 1)
    assert data[:4] == b"RIFF" and chunks == [b"fmt ", b"fact", b"data"]
    assert mutagen.File(out / "funk_groove.wav") is None or not mutagen.File(out / "funk_groove.wav").tags
    raw = tmp_path / "raw"
    (raw / "chords").mkdir(parents=True)
    shutil.copy(RAW / "chords" / "warm_piano_chords.flac", raw / "chords")  # Vorbis-commented source
    normalize_dir(raw, tmp_path / "out", Options(format="flac"))
    flac = FLAC(tmp_path / "out" / "chords" / "warm_piano_chords.flac")
    assert flac.info.bits_per_sample == 24 and flac.info.sample_rate == RATE
    assert not flac.tags or len(flac.tags) == 0
    assert json.loads((tmp_path / "out" / "chords" / "warm_piano_chords.json").read_text())["genre"] == "jazz"


def test_two_runs_give_byte_identical_outputs(demo, tmp_path):
    _, first = demo
    second = tmp_path / "again"
    normalize_dir(RAW, second)
    names = tree_files(first)
    assert names == tree_files(second)
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert mismatch == [] and errors == []


def test_rerun_into_the_same_folder_removes_stale_outputs(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    for name in ("a.wav", "b.wav"):
        sf.write(raw / name, noise(RATE, seed=len(name) + ord(name[0])), RATE, subtype="PCM_16")
    normalize_dir(raw, out)
    (raw / "b.wav").unlink()
    (out / ".leftover.wav.tmp").write_bytes(b"x")
    normalize_dir(raw, out)
    assert tree_files(out) == ["a.json", "a.wav", REPORT_NAME]


def test_length_cap_aligned_down_to_whole_latents(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    sf.write(raw / "long.wav", noise(2 * 48000), 48000, subtype="PCM_16")  # 2 s
    sf.write(raw / "short.wav", noise(RATE // 2, seed=1), RATE, subtype="PCM_16")  # 0.5 s: not padded or cut
    report = normalize_dir(raw, tmp_path / "out", Options(max_seconds=1.0))
    cap = RATE // LATENT_SAMPLES * LATENT_SAMPLES  # 40960
    assert sf.info(tmp_path / "out" / "long.wav").frames == cap
    assert sf.info(tmp_path / "out" / "short.wav").frames == RATE // 2
    assert report["capped"] == ["long.wav"]
    assert [f["source_seconds"] for f in report["files"]] == [2.0, 0.5]


def test_more_than_two_channels_first_two_or_downmix(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    four = noise(RATE, channels=4)
    sf.write(raw / "quad.wav", four, RATE, subtype="FLOAT")
    normalize_dir(raw, tmp_path / "first")
    np.testing.assert_array_equal(sf.read(tmp_path / "first" / "quad.wav", dtype="float32")[0], four[:, :2])
    normalize_dir(raw, tmp_path / "mix", Options(channels="downmix"))
    mixed = sf.read(tmp_path / "mix" / "quad.wav", dtype="float32")[0]
    np.testing.assert_allclose(mixed[:, 0], four.mean(axis=1), atol=1e-7)
    np.testing.assert_array_equal(mixed[:, 0], mixed[:, 1])


def test_odd_names_and_name_collisions(tmp_path):
    raw = tmp_path / "raw"
    (raw / "dir with space").mkdir(parents=True)
    odd = "dir with space/mélodie – ünïcode 🎵.wav"
    sf.write(raw / odd, noise(RATE), RATE, subtype="PCM_16")
    (raw / odd).with_suffix(".txt").write_text("a tune with an odd name", encoding="utf-8")
    sf.write(raw / "take.wav", noise(RATE, seed=1), RATE, subtype="PCM_16")
    sf.write(raw / "take.flac", noise(RATE, seed=2), RATE, subtype="PCM_16")
    sf.write(raw / "report.wav", noise(RATE, seed=3), RATE, subtype="PCM_16")
    (raw / "notes.md").write_text("not audio")
    report = normalize_dir(raw, tmp_path / "out")
    out = tmp_path / "out"
    assert tree_files(out) == sorted(
        [
            "dir with space/mélodie – ünïcode 🎵.json",
            "dir with space/mélodie – ünïcode 🎵.wav",
            "report-wav.json",
            "report-wav.wav",
            REPORT_NAME,
            "take-flac.json",
            "take-flac.wav",
            "take-wav.json",
            "take-wav.wav",
        ]
    )
    assert json.loads((out / odd).with_suffix(".json").read_text()) == {"prompt": "a tune with an odd name"}
    assert report["ignored"] == [{"path": "notes.md", "why": "not an audio extension"}]


def test_output_stems_are_deterministic_and_unique():
    names = ["a.wav", "a.flac", "A.mp3", "b/c.ogg", "a-wav.mp3", "report.flac", "b/report.wav"]
    stems = output_stems(names)
    assert stems == output_stems(list(reversed(names)))
    assert stems == {
        "A.mp3": "A-mp3",
        "a-wav.mp3": "a-wav",
        "a.flac": "a-flac",
        "a.wav": "a-wav-2",
        "b/c.ogg": "b/c",
        "b/report.wav": "b/report",
        "report.flac": "report-flac",
    }


def test_options_reject_unknown_or_bad_params():
    with pytest.raises(ValueError, match="normalize.sample_rte: unknown key"):
        Options.from_params({"sample_rte": 44100})
    with pytest.raises(ValueError, match="normalize.format: expected one of flac, wav"):
        Options.from_params({"format": "mp3"})
    with pytest.raises(ValueError, match="shorter than one latent"):
        Options.from_params({"max_seconds": 0.05})
    stage_params = yaml.safe_load((ROOT / "params.yaml").read_text())["normalize"]
    assert Options.from_params(stage_params) == Options()


# ------------------------------------------------------------------ the stage script


def stage_project(tmp_path, files, **params):
    """A folder with dvc.yaml (the stage reads the params it declares), params.yaml (defaults +
    overrides) and data/raw holding `files`."""
    defaults = yaml.safe_load((ROOT / "params.yaml").read_text())
    section = {**defaults["normalize"], **params}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"normalize": section, "model": defaults["model"]}))
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copytree(ROOT / "models" / defaults["model"]["base"], tmp_path / "models" / defaults["model"]["base"])
    raw = tmp_path / "data" / "raw"
    raw.mkdir(parents=True)
    for name, content in files.items():
        if isinstance(content, bytes):
            (raw / name).write_bytes(content)
        else:
            sf.write(raw / name, content, RATE, subtype="PCM_16")
    return tmp_path


def run_stage(project, monkeypatch):
    monkeypatch.chdir(project)
    stage = runpy.run_path(str(ROOT / "stages" / "normalize.py"), run_name="stage")
    return stage["main"]()


@pytest.mark.parametrize(
    "files, strict, code",
    [
        ({"good.wav": noise(RATE), "bad.wav": b""}, False, 0),
        ({"good.wav": noise(RATE), "bad.wav": b""}, True, 1),
        ({"good.wav": noise(RATE)}, True, 0),
        ({"bad.wav": b"", "worse.flac": b"text"}, False, 1),
    ],
)
def test_stage_exits_nonzero_only_if_nothing_usable_or_strict(tmp_path, monkeypatch, capsys, files, strict, code):
    project = stage_project(tmp_path, files, strict=strict)
    assert run_stage(project, monkeypatch) == code
    printed = capsys.readouterr()
    assert "normalize:" in printed.out and (project / "data" / "normalized" / REPORT_NAME).is_file()
    if code:
        assert ("nothing usable" in printed.err) != strict


def test_stage_prints_non_utf8_names_with_the_fix(tmp_path, monkeypatch, capsys):
    project = stage_project(tmp_path, {"good.wav": noise(RATE)})
    try:
        raw = os.fsencode(project / "data" / "raw")
        os.rename(os.path.join(raw, b"good.wav"), os.path.join(raw, b"\xff.wav"))
    except OSError:
        pytest.skip("this filesystem refuses non-UTF-8 names")
    sf.write(project / "data" / "raw" / "ok.wav", noise(RATE, seed=1), RATE, subtype="PCM_16")
    assert run_stage(project, monkeypatch) == 0
    out = capsys.readouterr().out
    assert f"\\xff.wav: {reasons.NON_UTF8_NAME} - rename it" in out
    assert "DVC fail" in out


# ------------------------------------------------------------------ under DVC


def dvc(args, cwd):
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["dvc", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"dvc {' '.join(args)}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def test_dvc_repro_normalize_then_nothing(tmp_path):
    for name in ("dvc.yaml", "params.yaml", "stages", "sa3mlx", "data/raw", "models/tiny-base"):
        src, dst = ROOT / name, tmp_path / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(src, dst)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    dvc(["init", "-q"], tmp_path)
    dvc(["config", "core.analytics", "false"], tmp_path)
    first = dvc(["repro", "normalize"], tmp_path)
    assert "Running stage 'normalize'" in first
    assert "exports/bass_line_copy.flac = bass_line.wav" in first
    report = json.loads((tmp_path / "data" / "normalized" / REPORT_NAME).read_text())
    assert report["counts"]["kept"] == 8
    assert "Running stage" not in dvc(["repro", "normalize"], tmp_path)
