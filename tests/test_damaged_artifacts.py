"""Issue 19: every damaged or missing artifact another stage wrote is one `sa3mlx: <stage>: <message>`
line naming the file and the fix, exit status 2, nothing computed changed; a seeded fuzz of byte
flips and truncations of every artifact kind."""

from __future__ import annotations

import json
import os
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
from user_error_project import (  # noqa: F401  (built, project: fixtures)
    ADAPTER,
    ARC,
    BASE,
    CHECKPOINT,
    FINGERPRINT,
    RATE,
    RUN_NAME,
    SONG_SAMPLES,
    assert_one_line,
    built,
    project,
    run_stage,
    set_param,
    snapshot,
    write_latents,
    write_normalized,
    write_run,
)

from sa3mlx.data.dataset import PreEncodedDataset
from sa3mlx.data.encode import Codec, EncodeOptions, decode_normalized, encode_dir, read_tags
from sa3mlx.data.encode_cache import LatentCache
from sa3mlx.lora.bases import read_bases
from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.models.config import T5GemmaConfig
from sa3mlx.models.same import load_same_encoder
from sa3mlx.models.tokenizer import PromptTokenizer
from sa3mlx.runtime import layout
from sa3mlx.runtime.errors import ArtifactError, UserError
from sa3mlx.runtime.shards import NORMALIZE_REPORT, open_tree
from sa3mlx.train.resume import find_resume, resume_files


# ---- damaged artifacts, through the stages -----------------------------------------------------------
def truncate(path: Path, keep: int = 90) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def garble(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGED = [
    # stage that reads it, file, damage, words in the message
    ("train", "data/latents/clip1.npy", truncate, ["data/latents/clip1.npy: damaged latents"]),
    ("train", "data/latents/clip0.json", truncate, ["data/latents/clip0.json: damaged latent sidecar"]),
    ("train", "data/latents/clip0.json", os.unlink, ["data/latents/clip0.json: missing (latent sidecar)"]),
    ("train", "models/converted/tiny-base/dit.npz", garble, ["tiny-base/dit.npz: damaged DiT weights (its sha256"]),
    ("train", "models/converted/tiny-base/model_config.json", truncate, ["tiny-base/model_config.json: damaged"]),
    ("encode", "models/converted/tiny-base/same_encoder.npz", os.unlink, ["same_encoder.npz: missing"]),
    ("encode", "models/converted/tiny-base/manifest.json", truncate, ["tiny-base/manifest.json: damaged manifest"]),
    ("demo", "models/lora/tiny-lora.safetensors", truncate, ["models/lora/tiny-lora.safetensors: damaged adapter"]),
    ("train", "models/svd/tiny-base/svd_bases.safetensors", truncate, ["svd_bases.safetensors: damaged SVD bases"]),
]


@pytest.mark.parametrize("stage, name, damage, words", DAMAGED, ids=[f"{c[0]}:{c[1]}:{c[2].__name__}" for c in DAMAGED])
def test_a_damaged_artifact_is_one_line_with_the_fix(project, capsys, stage, name, damage, words):
    damage(project / name)
    if "svd_bases" in name:  # only an -xs adapter reads the bases
        set_param(project, "train.adapter", {"adapter_type": "lora-xs", "rank": 4})
    before = snapshot(project)
    status, err = run_stage(stage, capsys)
    out = next(o for folder, o in FIXES if name.startswith(folder))
    assert_one_line(status, err, stage, *words, f"`dvc checkout {out}`")
    assert snapshot(project) == before


FIXES = [  # the DVC output holding each file (dvc.lock of this repo)
    ("data/latents", "data/latents"),
    ("models/converted/tiny-base", "models/converted/tiny-base"),
    ("models/lora", "models/lora/tiny-lora.safetensors"),
    ("models/svd/tiny-base", "models/svd/tiny-base"),
]


def test_normalized_audio_damaged_is_named_and_the_rest_encoded(project, capsys):
    truncate(project / "data/normalized/song1.wav", 30)
    status, err = run_stage("encode", capsys)
    assert_one_line(status, err, "encode", "data/normalized/song1.wav: damaged normalized audio", "dvc checkout")
    assert (project / "data/latents/song0.npy").is_file()


def test_a_damaged_resume_state_is_refused_and_the_run_kept(project, capsys):
    run_dir = project / layout.run_dir(RUN_NAME)
    checkpoint = run_dir / CHECKPOINT
    npz = resume_files(checkpoint)[0]
    garble(npz, 100)
    before = snapshot(project)
    with pytest.raises(ArtifactError) as refused:
        find_resume(run_dir, FINGERPRINT)
    message = str(refused.value)
    assert f"{resume_files(checkpoint)[1].name}: its arrays ({npz.name}) are missing or do not match" in message
    assert f"train.init_from: models/lora/{checkpoint.name}" in message
    assert f"mv runs/{RUN_NAME}/{CHECKPOINT} models/lora/" in message
    assert snapshot(project) == before


def test_train_stage_refuses_a_damaged_resume_state_before_touching_the_run(project, capsys):
    json_path = resume_files(project / layout.run_dir(RUN_NAME) / CHECKPOINT)[1]
    truncate(json_path, 40)
    before = snapshot(project)
    status, err = run_stage("train", capsys)
    assert_one_line(status, err, "train", f"{json_path.name}: unreadable resume state", "train.init_from")
    assert snapshot(project) == before


def test_encode_cache_drops_a_damaged_entry_and_reencodes_that_file_only(project, capsys):
    codec = Codec.open(project / layout.converted_dir(BASE))
    options, cache = EncodeOptions(), project / layout.ENCODE_CACHE_DIR
    normalized, latents = project / layout.NORMALIZED_DIR, project / layout.LATENTS_DIR
    first = encode_dir(normalized, latents, cache, codec, options, BASE, log=lambda line: None)
    assert first.encoded == 2 and not first.errors
    expected = (latents / "song1.npy").read_bytes()
    entries = sorted(cache.rglob("*.npy"))
    damaged = next(p for p in entries if json.loads(p.with_suffix(".json").read_text())["source"].endswith("song1.wav"))
    truncate(damaged, 100)
    lines = []
    again = encode_dir(normalized, latents, cache, codec, options, BASE, log=lines.append)
    assert (again.encoded, again.skipped, again.errors) == (1, 1, [])
    assert any("dropped a damaged cache entry" in line for line in lines)
    assert (latents / "song1.npy").read_bytes() == expected


# ---- seeded fuzz: byte flips and truncations of every artifact kind ------------------------------------
def corruptions(data: bytes, seed: int, count: int = 8):
    """`count` damaged copies of `data`: at even positions flips of 1-3 bits, at odd ones a truncation
    (the first to an empty file)."""
    rng = random.Random(seed)
    for i in range(count):
        if i % 2:
            yield bytes(data[: 0 if i == 1 else rng.randrange(1, len(data))])
        else:
            damaged = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
            yield bytes(damaged)


def tokenizer(folder: Path) -> PromptTokenizer:
    return PromptTokenizer.from_folder(folder, 16, 0)


def fuzz_readers(root: Path) -> dict:
    """Artifact kind -> (file to damage, the reader a stage calls on it)."""
    converted, cache = root / layout.converted_dir(BASE), LatentCache(root / layout.ENCODE_CACHE_DIR)
    checkpoint = root / layout.run_dir(RUN_NAME) / CHECKPOINT
    key = "ab" + "0" * 62
    cache.put(key, np.ones((16, 5), np.float32), np.ones(5), 5 * 4096, {"source": "x.wav"})
    npy, meta = (
        root / layout.ENCODE_CACHE_DIR / "ab" / f"{key}.npy",
        root / layout.ENCODE_CACHE_DIR / "ab" / f"{key}.json",
    )
    latents, song = root / layout.LATENTS_DIR, root / layout.NORMALIZED_DIR / "song0.wav"

    def normalized():  # opened at each read: a member's size is taken when its folder is opened
        return open_tree(song.parent, NORMALIZE_REPORT)

    return {
        "latents npy": (
            latents / "clip0.npy",
            lambda: PreEncodedDataset(latents, 32).example(0, np.random.default_rng(0)),
        ),
        "latents json": (
            latents / "clip0.json",
            lambda: PreEncodedDataset(latents, 32).example(0, np.random.default_rng(0)),
        ),
        "normalized audio": (
            song,
            lambda: decode_normalized(normalized().span(song.name), song.read_bytes(), SONG_SAMPLES),
        ),
        "tag sidecar": (song.with_suffix(".json"), lambda: read_tags(normalized(), song.name)),
        "converted npz": (converted / "same_encoder.npz", lambda: load_same_encoder(converted / "same_encoder.npz")),
        "manifest": (converted / "manifest.json", lambda: Codec.open(converted)),
        "model config": (converted / "model_config.json", lambda: Codec.open(converted)),
        "tokenizer": (converted / "t5gemma" / "tokenizer.json", lambda: tokenizer(converted / "t5gemma")("a b")),
        "tokenizer config": (converted / "t5gemma" / "tokenizer_config.json", lambda: tokenizer(converted / "t5gemma")),
        "t5gemma config": (converted / "t5gemma" / "config.json", lambda: T5GemmaConfig.load(converted / "t5gemma")),
        "svd bases": (root / layout.svd_dir(BASE) / layout.SVD_FILE, lambda: read_bases(root / layout.svd_dir(BASE))),
        "adapter": (root / layout.adapter_path(RUN_NAME), lambda: read_lora(root / layout.adapter_path(RUN_NAME))),
        "resume npz": (resume_files(checkpoint)[0], lambda: find_resume(checkpoint.parents[2], FINGERPRINT)),
        "resume json": (resume_files(checkpoint)[1], lambda: find_resume(checkpoint.parents[2], FINGERPRINT)),
        "cache npy": (npy, lambda: cache.get(key)),
        "cache json": (meta, lambda: cache.get(key)),
    }


FUZZ_KINDS = (
    "latents npy",
    "latents json",
    "normalized audio",
    "tag sidecar",
    "converted npz",
    "manifest",
    "model config",
    "tokenizer",
    "tokenizer config",
    "t5gemma config",
    "svd bases",
    "adapter",
    "resume npz",
    "resume json",
    "cache npy",
    "cache json",
)


@pytest.mark.parametrize("kind", FUZZ_KINDS)
def test_fuzz_damage_is_refused_in_one_line_or_harmless(project, kind):
    """Each damaged copy either reads (a flip no check can see, e.g. in a sample) or is a UserError of
    one line naming the file (or its folder); never another exception, and never a truncated copy read."""
    readers = fuzz_readers(project)
    path, reader = readers[kind]
    companions = {p: p.read_bytes() for p in path.parent.iterdir() if p.is_file()}
    reader()  # the intact file reads
    for seed, damaged in enumerate(corruptions(companions[path], seed=zlib.crc32(kind.encode()))):
        path.write_bytes(damaged)
        try:
            result = reader()
        except UserError as e:
            text = str(e)
            assert "\n" not in text and (path.name in text or path.parent.name in text), (kind, seed, text)
        else:
            dropped = kind.startswith("cache") and result is None
            if dropped:  # both files of the entry gone
                assert not path.exists() and not path.with_suffix(".json").exists(), (kind, seed)
            assert dropped or not seed % 2, f"{kind}: a truncated copy ({len(damaged)} bytes) was accepted"
        for restored, data in companions.items():
            restored.write_bytes(data)
