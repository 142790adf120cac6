"""Reuse of a stage's previous output (the version dvc.lock records, read from the DVC cache) by
normalize and encode, in both layouts: unchanged items are not decoded / encoded again, outputs
stay byte-identical to a full run, a settings change recomputes everything, a damaged object is
recomputed, never copied. `tests/test_dvc_reuse.py` does the same through real `dvc` and a remote."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from conftest import ROOT

from sa3mlx.audio import normalize as N
from sa3mlx.audio.write import write_float_wav
from sa3mlx.convert.model import convert_source
from sa3mlx.data import encode as enc
from sa3mlx.data.dataset import PreEncodedDataset
from sa3mlx.data.encode import Codec, EncodeOptions, encode_dir
from sa3mlx.runtime import shards as S
from sa3mlx.runtime.previous import LOCK_FILE, previous_output

RATE = 44100
SUMMARIES = {"data/normalized": S.NORMALIZE_REPORT, "data/latents": S.ENCODE_DETAILS}


def dvc_commit(project, out: str) -> None:
    """What `dvc commit` leaves for an output folder: its files as md5-named objects in .dvc/cache,
    the `.dir` listing, and the entry in dvc.lock."""
    objects = project / ".dvc" / "cache" / "files" / "md5"
    folder = project / out
    entries = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        md5 = hashlib.md5(path.read_bytes()).hexdigest()
        (objects / md5[:2]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, objects / md5[:2] / md5[2:])
        entries.append({"md5": md5, "relpath": path.relative_to(folder).as_posix()})
    listing = json.dumps(entries).encode()
    md5 = hashlib.md5(listing).hexdigest() + ".dir"
    (objects / md5[:2]).mkdir(parents=True, exist_ok=True)
    (objects / md5[:2] / md5[2:]).write_bytes(listing)
    (project / LOCK_FILE).write_text(
        json.dumps({"stages": {"s": {"outs": [{"path": out, "hash": "md5", "md5": md5}]}}})
    )


def damage_object(project, out: str, member: str) -> None:
    """Flip a byte of the cache object that holds `member` of `out` (its file, or its shard)."""
    previous = previous_output(out, SUMMARIES[out], project)
    span = previous.member(member)
    data = bytearray(span.path.read_bytes())
    data[span.offset + span.size // 2] ^= 0xFF
    span.path.chmod(0o644)
    span.path.write_bytes(bytes(data))


def tree_bytes(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    folder = tmp_path_factory.mktemp("codec") / "tiny-base"
    convert_source(ROOT / "models" / "tiny-base", folder)
    return Codec.open(folder)


@pytest.fixture
def counted(monkeypatch):
    """Counts of audio decoded by normalize and files encoded by encode."""
    calls = {"decoded": 0, "encoded": 0}
    prepare, encode_audio = N._prepare, enc.encode_audio

    def counting_prepare(*args):
        calls["decoded"] += 1
        return prepare(*args)

    def counting_encode(*args):
        calls["encoded"] += 1
        return encode_audio(*args)

    monkeypatch.setattr(N, "_prepare", counting_prepare)
    monkeypatch.setattr(enc, "encode_audio", counting_encode)
    return calls


class Project:
    """data/raw (a copy of the demo data), the two stages run like `dvc repro` runs them: each
    into an emptied output folder, with the previous output from the (fake) DVC cache."""

    def __init__(self, root, codec, layout):
        self.root, self.codec, self.layout = root, codec, layout
        shutil.copytree(ROOT / "data" / "raw", root / "data" / "raw")
        self.log = []

    def normalize(self, **settings):
        out = self.root / "data" / "normalized"
        shutil.rmtree(out, ignore_errors=True)
        options = N.Options(layout=self.layout, **settings)
        previous = previous_output("data/normalized", S.NORMALIZE_REPORT, self.root)
        N.normalize_dir(self.root / "data" / "raw", out, options, previous, self.log.append)
        return out

    def encode(self, **settings):
        out = self.root / "data" / "latents"
        shutil.rmtree(out, ignore_errors=True)
        options = EncodeOptions(layout=self.layout, **settings)
        previous = previous_output("data/latents", S.ENCODE_DETAILS, self.root)
        cache = self.root / "data" / "encode_cache"
        summary = encode_dir(
            self.root / "data" / "normalized", out, cache, self.codec, options, "tiny-base", self.log.append, previous
        )
        return summary

    def commit(self, out):
        dvc_commit(self.root, out)

    def add_clip(self, name, seconds=3.0, seed=3):
        audio = (0.1 * np.random.default_rng(seed).standard_normal((int(seconds * RATE), 2))).astype(np.float32)
        write_float_wav(self.root / "data" / "raw" / name, audio, RATE)  # no timestamp: the same bytes each time


@pytest.mark.parametrize("layout", ["files", "shards"])
def test_normalize_takes_unchanged_inputs_from_the_previous_output(tmp_path, codec, counted, layout):
    project = Project(tmp_path / "p", codec, layout)
    full = tree_bytes(project.normalize())
    decoded = counted["decoded"]
    assert decoded == 9
    project.commit("data/normalized")
    assert tree_bytes(project.normalize()) == full and counted["decoded"] == decoded  # nothing decoded again
    assert project.log[-1].startswith("normalize: 0 decoded and resampled, 9 unchanged taken")
    project.add_clip("added.wav")
    project.normalize()
    assert counted["decoded"] == decoded + 1
    reference = Project(tmp_path / "ref", codec, layout)
    reference.add_clip("added.wav")
    assert tree_bytes(project.root / "data/normalized") == tree_bytes(reference.normalize())  # = a full run
    project.commit("data/normalized")
    before = counted["decoded"]
    project.normalize(silence_dbfs=-70.0)  # an audio setting: everything again
    assert counted["decoded"] == before + 10
    project.normalize()  # the committed version was made with -80: reused
    assert counted["decoded"] == before + 10
    damage_object(project.root, "data/normalized", "bass_line.wav")
    project.normalize()
    # the files in the damaged object, and exports/bass_line_copy.flac (its duplicate, the same audio)
    again = 1 if layout == "files" else _items_in_shard(project, "bass_line")
    assert counted["decoded"] == before + 10 + again + 1
    assert "damaged in the DVC cache, recomputed" in project.log[-1]
    assert tree_bytes(project.root / "data/normalized") == tree_bytes(reference.root / "data/normalized")


def _items_in_shard(project, stem: str) -> int:
    shard = S.shard_of(f"{stem}.wav")
    names = S.open_tree(project.root / "data" / "normalized", S.NORMALIZE_REPORT).names()
    return sum(1 for n in names if n.endswith(".wav") and S.shard_of(n) == shard)


@pytest.mark.parametrize("layout", ["files", "shards"])
def test_encode_takes_unchanged_latents_from_the_previous_output(tmp_path, codec, counted, layout):
    project = Project(tmp_path / "p", codec, layout)
    project.normalize()
    assert project.encode().encoded == 8
    full = tree_bytes(project.root / "data" / "latents")
    project.commit("data/latents")
    shutil.rmtree(project.root / "data" / "encode_cache")  # a teammate's clone: only the DVC cache
    summary = project.encode()
    assert (summary.encoded, summary.skipped, counted["encoded"]) == (0, 8, 8)
    assert tree_bytes(project.root / "data" / "latents") == full
    assert any("reused from the previous output" in line for line in project.log)
    assert project.encode(chunk_above_seconds=10).encoded == 8  # a real change is never hidden
    shutil.rmtree(project.root / "data" / "encode_cache")
    damage_object(project.root, "data/latents", "bass_line.npy")
    summary = project.encode()
    assert summary.encoded == (1 if layout == "files" else _latents_in_shard(project, "bass_line"))
    assert tree_bytes(project.root / "data" / "latents") == full
    assert any("damaged in the DVC cache, encoded again" in line for line in project.log)


def _latents_in_shard(project, stem: str) -> int:
    shard = S.shard_of(f"{stem}.npy")
    return sum(
        1
        for n in S.open_tree(project.root / "data" / "latents", S.ENCODE_DETAILS).names()
        if n.endswith(".npy") and S.shard_of(n) == shard
    )


def test_a_damaged_local_cache_entry_is_encoded_again(tmp_path, codec, counted):
    project = Project(tmp_path / "p", codec, "files")
    project.normalize()
    project.encode()
    full = tree_bytes(project.root / "data" / "latents")
    entry = next((project.root / "data" / "encode_cache").rglob("*.npy"))
    entry.write_bytes(entry.read_bytes()[:-4] + b"\0\0\0\1")
    assert project.encode().encoded == 1
    assert tree_bytes(project.root / "data" / "latents") == full


def test_shards_encode_one_changed_clip_rewrites_one_shard_and_reads_like_files(tmp_path, codec, counted):
    project = Project(tmp_path / "p", codec, "shards")
    project.normalize()
    project.encode()
    latents = project.root / "data" / "latents"
    before = {p.name[:3]: p.read_bytes() for p in (latents / S.SHARDS_DIR).iterdir()}
    project.add_clip("added.wav")
    project.normalize()
    summary = project.encode()
    assert (summary.encoded, summary.skipped) == (1, 8)
    after = {p.name[:3]: p.read_bytes() for p in (latents / S.SHARDS_DIR).iterdir()}
    assert {n for n in after if before.get(n) != after[n]} == {S.shard_of("added.npy")}
    files = Project(tmp_path / "f", codec, "files")
    files.add_clip("added.wav")
    files.normalize()
    files.encode()
    sharded_ds, files_ds = PreEncodedDataset(latents, 8), PreEncodedDataset(files.root / "data" / "latents", 8)
    assert [f.relpath for f in sharded_ds.files] == [f.relpath for f in files_ds.files]
    for i in range(len(files_ds)):
        a, b = sharded_ds.example(i, np.random.default_rng(i)), files_ds.example(i, np.random.default_rng(i))
        assert np.array_equal(a.latents, b.latents) and np.array_equal(a.padding_mask, b.padding_mask)
        assert {**a.info, "latent_filename": "", "path": ""} == {
            **b.info,
            "latent_filename": "",
            "path": "",
        }  # roots differ
