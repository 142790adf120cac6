"""The `encode` stage: latents + sidecars on the demo data, the content cache (incremental,
resumable, invalidated by codec and params), sharding, and a real `dvc repro`."""

import json
import math
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
from conftest import ROOT
from dvc_project import make_project, run

from sa3mlx.audio.normalize import LATENT_SAMPLES, normalize_dir
from sa3mlx.audio.write import write_float_wav
from sa3mlx.convert.model import convert_source
from sa3mlx.data import encode as enc
from sa3mlx.data.dataset import encoded_share
from sa3mlx.data.encode import Codec, EncodeOptions, encode_dir, parse_shard
from sa3mlx.models.same_chunked import encode_long
from sa3mlx.runtime.io import sha256_file

RATE = 44100
SIDECAR_KEYS = [
    "path",
    "relpath",
    "src_relpath",
    "seconds_total",
    "seconds_start",
    "audio_samples",
    "latent_shape",
    "padding_mask",
]
SUMMARY = re.compile(r"Done in .+?: (\d+) encoded, (\d+) skipped, (\d+) errors")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The demo data normalised and the tiny-base codec converted, once per module."""
    root = tmp_path_factory.mktemp("prepared")
    report = normalize_dir(ROOT / "data" / "raw", root / "normalized")
    convert_source(ROOT / "models" / "tiny-base", root / "codec")
    return root, report


@pytest.fixture
def work(prepared, tmp_path, monkeypatch):
    """A writable copy of the normalised data, a log, and a counter of encoder calls."""
    root, report = prepared
    shutil.copytree(root / "normalized", tmp_path / "normalized")
    calls, log = [], []
    original = enc.encode_audio

    def counted(encoder, audio, rate, options):
        calls.append(audio.shape[-1])
        if work.crash_after is not None and len(calls) > work.crash_after:
            raise KeyboardInterrupt  # like a kill: not caught as a per-file error
        return original(encoder, audio, rate, options)

    monkeypatch.setattr(enc, "encode_audio", counted)

    class Work:
        crash_after = None
        codec = Codec.open(root / "codec")

        def run(self, options=EncodeOptions(), codec=None):
            calls.clear()
            summary = encode_dir(
                tmp_path / "normalized",
                tmp_path / "latents",
                tmp_path / "cache",
                codec or self.codec,
                options,
                "tiny-base",
                log=log.append,
            )
            assert SUMMARY.fullmatch(summary.line())
            return summary

    work = Work()
    work.root, work.tmp, work.report, work.calls, work.log = root, tmp_path, report, calls, log
    return work


def outputs(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def add_clip(folder, name, seconds=3.0, seed=1):
    audio = (0.1 * np.random.default_rng(seed).standard_normal((int(seconds * RATE), 2))).astype(np.float32)
    write_float_wav(folder / f"{name}.wav", audio, RATE)
    (folder / f"{name}.json").write_text(json.dumps({"prompt": f"noise {name}"}))


def test_demo_latents_and_sidecars(work):
    summary = work.run()
    assert (summary.encoded, summary.skipped, summary.errors) == (8, 0, [])
    assert summary.line().endswith(": 8 encoded, 0 skipped, 0 errors")
    assert [line[:5] for line in work.log] == [f"[{i}/8]" for i in range(1, 9)]
    assert "files/s" in work.log[0] and "audio-s/s" in work.log[0]
    normalized, latents = work.tmp / "normalized", work.tmp / "latents"
    files = {r["output"]: r for r in work.report["files"]}
    assert sorted(files) == enc.list_audio(normalized)
    for rel, record in files.items():
        stem = rel[: -len(".wav")]
        meta = json.loads((latents / f"{stem}.json").read_text())
        tags = json.loads((normalized / f"{stem}.json").read_text())
        assert list(meta) == SIDECAR_KEYS + list(tags)
        samples = record["samples"]
        count = work.codec.encoder.latent_count(samples)
        latent = np.load(latents / f"{stem}.npy")
        assert latent.dtype == np.float32 and latent.shape == (16, count)
        assert meta == {
            "path": (normalized / rel).as_posix(),
            "relpath": f"{stem}.npy",
            "src_relpath": record["source"],
            "seconds_total": round(samples / RATE, 3),
            "seconds_start": 0,
            "audio_samples": samples,
            "latent_shape": [16, count],
            "padding_mask": [1] * math.ceil(samples / LATENT_SAMPLES)
            + [0] * (count - math.ceil(samples / LATENT_SAMPLES)),
            **tags,
        }
    # unscaled, one unchunked pass for these short clips: exactly the encoder's output
    audio, _ = sf.read(normalized / "loops/four_on_the_floor.wav", dtype="float32", always_2d=True)
    direct = np.array(work.codec.encoder(mx.array(audio.T[None]))[0])
    np.testing.assert_array_equal(np.load(latents / "loops/four_on_the_floor.npy"), direct)
    assert (
        json.loads((latents / "loops/four_on_the_floor.json").read_text())["src_relpath"]
        == "loops/four_on_the_floor.wav"
    )
    assert json.loads((latents / "bass_line.json").read_text())["prompt"]  # tags from the raw json sidecar
    details = json.loads((latents / "details.json").read_text())
    assert {
        k: details[k]
        for k in (
            "model",
            "sample_rate",
            "audio_channels",
            "downsampling_ratio",
            "latent_dim",
            "scale",
            "num_files",
            "num_errors",
            "max_samples",
        )
    } == {
        "model": "tiny-base",
        "sample_rate": RATE,
        "audio_channels": 2,
        "downsampling_ratio": 4096,
        "latent_dim": 16,
        "scale": 1.0,
        "num_files": 8,
        "num_errors": 0,
        "max_samples": None,
    }
    assert details["seconds_total"] == work.report["seconds_total"]


def test_second_run_is_a_noop(work):
    work.run()
    first = outputs(work.tmp / "latents")
    summary = work.run()
    assert work.calls == [] and (summary.encoded, summary.skipped) == (0, 8)
    assert outputs(work.tmp / "latents") == first


def test_adding_one_encodes_one_and_removing_one_encodes_none(work):
    normalized, latents = work.tmp / "normalized", work.tmp / "latents"
    work.run()
    add_clip(normalized / "loops", "new clip é")
    summary = work.run()
    assert len(work.calls) == 1 and (summary.encoded, summary.skipped) == (1, 8)
    assert json.loads((latents / "loops/new clip é.json").read_text())["prompt"] == "noise new clip é"
    for name in ("bass_line.wav", "bass_line.json"):
        (normalized / name).unlink()
    summary = work.run()
    assert work.calls == [] and (summary.encoded, summary.skipped) == (0, 8)
    assert not (latents / "bass_line.npy").exists() and not (latents / "bass_line.json").exists()
    assert json.loads((latents / "details.json").read_text())["num_files"] == 8


def test_params_or_codec_change_reencodes_all(work):
    work.run()
    before = np.load(work.tmp / "latents" / "ambient_sweep.npy")
    assert work.run(EncodeOptions(overlap=16)).encoded == 8 and len(work.calls) == 8
    assert work.run(EncodeOptions(chunk_above_seconds=10)).encoded == 8
    assert work.run().encoded == 0  # the first setting is still cached
    other = work.tmp / "codec2"
    shutil.copytree(work.root / "codec", other)
    with np.load(other / "same_encoder.npz") as f:
        arrays = dict(f)
    arrays["layers.2.weight"] = arrays["layers.2.weight"] * 1.5
    np.savez(other / "same_encoder.npz", **arrays)
    manifest = json.loads((other / "manifest.json").read_text())  # another codec, not a damaged one
    manifest["files"]["same_encoder.npz"]["sha256"] = sha256_file(other / "same_encoder.npz")
    (other / "manifest.json").write_text(json.dumps(manifest))
    summary = work.run(codec=Codec.open(other))
    assert summary.encoded == 8 and len(work.calls) == 8
    assert not np.array_equal(np.load(work.tmp / "latents" / "ambient_sweep.npy"), before)


def test_crash_then_rerun_encodes_only_unfinished(work):
    work.crash_after = 3
    with pytest.raises(KeyboardInterrupt):
        work.run()
    latents = work.tmp / "latents"
    for npy in latents.rglob("*.npy"):  # whatever is visible is complete
        assert np.load(npy).shape[0] == 16
    assert not list(work.tmp.rglob("*.tmp"))
    # a kill -9 mid-write leaves a temporary behind; DVC deletes the output folder before rerunning
    (work.tmp / "cache" / ".x.npy.abc.tmp").write_bytes(b"half")
    shutil.rmtree(latents)
    work.crash_after = None
    summary = work.run()
    assert (summary.encoded, summary.skipped, len(work.calls)) == (5, 3, 5)
    assert not list(work.tmp.rglob("*.tmp"))
    assert work.run().encoded == 0


def test_long_file_uses_production_chunks(work):
    normalized = work.tmp / "normalized"
    options = EncodeOptions(chunk_latents=8, overlap=2, chunk_above_seconds=5)
    audio, _ = sf.read(normalized / "ambient_sweep.wav", dtype="float32", always_2d=True)
    expected, mask = encode_long(work.codec.encoder, audio.T[None], 8, 2)
    work.run(options)
    got = np.load(work.tmp / "latents" / "ambient_sweep.npy")
    np.testing.assert_array_equal(got, np.array(expected[0]))
    assert got.shape[-1] == work.codec.encoder.latent_count(audio.shape[0])
    meta = json.loads((work.tmp / "latents" / "ambient_sweep.json").read_text())
    assert meta["padding_mask"] == mask[0].astype(int).tolist()
    unchunked = np.array(work.codec.encoder(mx.array(audio.T[None]))[0])
    assert not np.array_equal(got, unchunked)  # chunking did happen


def test_shards_split_the_work_and_fill_the_cache(work):
    done = []
    for i in range(3):
        summary = work.run(EncodeOptions(shard=f"{i}/3"))
        done.append(summary.encoded)
        assert not (work.tmp / "latents" / "details.json").exists()
        warning = encoded_share(work.tmp / "latents")  # what the train stage prints on such a folder
        assert f"holds only share {i}/3 of the corpus ({summary.total} files" in warning
    assert sum(done) == 8
    summary = work.run()
    assert (summary.encoded, summary.skipped) == (0, 8)
    assert encoded_share(work.tmp / "latents") is None  # the unsharded run removed the share record


def test_reserved_names_tag_clashes_and_bad_files(work):
    normalized, latents = work.tmp / "normalized", work.tmp / "latents"
    add_clip(normalized, "silence")
    (normalized / "silence.json").write_text(json.dumps({"path": "evil", "genre": "noise"}))
    (normalized / "broken.wav").write_bytes(b"RIFF not really")
    summary = work.run()
    assert [e["path"] for e in summary.errors] == ["broken.wav"]
    assert summary.line().endswith("9 encoded, 0 skipped, 1 errors")
    meta = json.loads((latents / "silence-audio.json").read_text())
    assert meta["path"].endswith("silence.wav") and meta["genre"] == "noise"
    assert (latents / "silence-audio.npy").exists() and not (latents / "silence.npy").exists()
    assert any("clash" in line for line in work.log)


def test_options_are_checked():
    assert parse_shard("2/4") == (2, 4) and parse_shard(None) is None
    for bad in ({"shard": "4/4"}, {"shard": "x"}, {"overlap": 128}, {"chunk": 3}):
        with pytest.raises(ValueError):
            EncodeOptions.from_params(bad)


def test_dvc_repro_encodes_only_the_new_file(tmp_path):
    make_project(tmp_path)
    first = run(["dvc", "repro", "encode"], tmp_path)
    assert re.search(r"Done in .+?: 8 encoded, 0 skipped, 0 errors", first)
    assert len(list((tmp_path / "data" / "latents").rglob("*.npy"))) == 8
    audio = (0.1 * np.random.default_rng(5).standard_normal((3 * RATE, 2))).astype(np.float32)
    sf.write(tmp_path / "data" / "raw" / "added.wav", audio, RATE, subtype="FLOAT")
    second = run(["dvc", "repro", "encode"], tmp_path)
    assert re.search(r"Done in .+?: 1 encoded, 8 skipped, 0 errors", second)
    assert (tmp_path / "data" / "latents" / "added.npy").exists()
    assert "Running stage" not in run(["dvc", "repro", "encode"], tmp_path)
    assert "encode_cache" not in run(["git", "status", "--porcelain", "--untracked-files=all", "data"], tmp_path)
