"""Issue 19: every bad param and every damaged artifact is one `sa3mlx: <stage>: <message>` line
naming the key or file (and the fix), exit status 2, no traceback, nothing computed changed.

The stages run in-process (`guarded`, as their `__main__` does) on a small project whose "computed"
outputs are real files: converted models, svd bases, latents, normalized audio, a run with a
resume state, the final adapter. A few runs go through `python stages/<x>.py` and `dvc exp run -S`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import runpy
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml
from conftest import FIXTURES, ROOT
from dvc_project import commit_all, init_repo, run

from sa3mlx.convert.model import convert_source
from sa3mlx.data.dataset import PreEncodedDataset
from sa3mlx.data.encode import Codec, EncodeOptions, decode_normalized, encode_dir, read_tags
from sa3mlx.data.encode_cache import LatentCache
from sa3mlx.lora.bases import compute_svd_file, read_bases
from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.models.config import T5GemmaConfig
from sa3mlx.models.same import load_same_encoder
from sa3mlx.models.tokenizer import PromptTokenizer
from sa3mlx.runtime import layout
from sa3mlx.runtime.errors import DEBUG_ENV, USER_ERROR_STATUS, ArtifactError, UserError, guarded
from sa3mlx.runtime.params import dvc_stages
from sa3mlx.runtime.schema import positive
from sa3mlx.runtime.shards import NORMALIZE_REPORT, open_tree
from sa3mlx.train.resume import ResumeState, find_resume, resume_files, save_resume

ADAPTER = FIXTURES / "lora" / "dit_dora_rows.safetensors"
RATE = layout.SAMPLE_RATE
BASE, ARC, RUN_NAME = "tiny-base", "tiny-arc", "tiny-lora"
CHECKPOINT = f"00000000/checkpoints/{RUN_NAME}-step=00000025-epoch=00000001.safetensors"
FINGERPRINT = "f" * 64
SONG_SAMPLES = RATE // 4


# ---- the project -------------------------------------------------------------------------------------
def write_latents(folder: Path, name: str, frames: int, seed: int) -> None:
    latents = np.random.default_rng(seed).standard_normal((16, frames)).astype(np.float32)
    np.save(folder / f"{name}.npy", latents)
    sidecar = {"seconds_total": 1.5, "padding_mask": [1] * frames, "prompt": name, "latent_shape": [16, frames]}
    (folder / f"{name}.json").write_text(json.dumps(sidecar))


def write_normalized(folder: Path, name: str, seed: int) -> None:
    audio = np.random.default_rng(seed).uniform(-0.5, 0.5, (SONG_SAMPLES, 2)).astype(np.float32)
    sf.write(folder / f"{name}.wav", audio, RATE, subtype="FLOAT")
    (folder / f"{name}.json").write_text(json.dumps({"genre": "noise", "bpm": "120"}))


def write_run(root: Path) -> Path:
    checkpoint = root / layout.run_dir(RUN_NAME) / CHECKPOINT
    checkpoint.parent.mkdir(parents=True)
    shutil.copyfile(ADAPTER, checkpoint)
    state = ResumeState(
        step=25,
        epoch=1,
        fingerprint=FINGERPRINT,
        sampler={"epoch": 1, "position": 3},
        session={"step": 25, "moments": np.arange(6, dtype=np.float32)},
        adapter={"layer.lora_A": np.ones((2, 3), np.float32)},
        checkpoint=checkpoint.name,
    )
    save_resume(checkpoint, state)
    return checkpoint


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A project with every stage's output present (built once; tests work on copies)."""
    root = tmp_path_factory.mktemp("built")
    for name in ("dvc.yaml", "dvc.lock", "params.yaml", f"models/{BASE}", f"models/{ARC}", "data/raw"):
        src, dst = ROOT / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst) if src.is_dir() else shutil.copyfile(src, dst)
    for name in (BASE, ARC):
        convert_source(root / layout.source_model_dir(name), root / layout.converted_dir(name))
    compute_svd_file(root / layout.converted_dir(BASE), root / layout.svd_dir(BASE), 8)
    latents = root / layout.LATENTS_DIR
    latents.mkdir(parents=True)
    for i, frames in enumerate((40, 48)):
        write_latents(latents, f"clip{i}", frames, seed=i)
    normalized = root / layout.NORMALIZED_DIR
    normalized.mkdir(parents=True)
    for i in range(2):
        write_normalized(normalized, f"song{i}", seed=i)
    census = [{"output": f"song{i}.wav", "source": f"song{i}.wav", "samples": SONG_SAMPLES} for i in range(2)]
    (normalized / "report.json").write_text(json.dumps({"files": census}))
    write_run(root)
    (root / layout.LORA_DIR).mkdir(parents=True)
    shutil.copyfile(ADAPTER, root / layout.adapter_path(RUN_NAME))
    return root


@pytest.fixture
def project(built, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "project"
    shutil.copytree(built, root)
    monkeypatch.chdir(root)
    return root


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file except params.yaml (what the tests edit)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != layout.PARAMS_FILE and "__pycache__" not in p.parts
    }


def set_param(root: Path, dotted: str, value) -> None:
    path = root / layout.PARAMS_FILE
    params = yaml.safe_load(path.read_text())
    *sections, key = dotted.split(".")
    node = params
    for section in sections:
        node = node[section]
    node[key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def run_stage(stage: str, capsys) -> tuple[int, list[str]]:
    """`stages/<stage>.py` as its `__main__` runs it: (exit status, stderr lines)."""
    capsys.readouterr()
    main = runpy.run_path(str(ROOT / "stages" / f"{stage}.py"), run_name="stage")["main"]
    argv = sys.argv
    sys.argv = [f"stages/{stage}.py"]
    try:
        status = guarded(stage, main)
    finally:
        sys.argv = argv
    return status, capsys.readouterr().err.splitlines()


def assert_one_line(status: int, err: list[str], stage: str, *words: str) -> None:
    assert status == USER_ERROR_STATUS, err
    assert len(err) == 1, err
    assert err[0].startswith(f"sa3mlx: {stage}: "), err
    assert "Traceback" not in err[0]
    for word in words:
        assert word in err[0], (word, err[0])


# ---- bad params: each stage x each class --------------------------------------------------------------
BAD_PARAMS = [
    # stage, key, value, words in the message
    ("convert", "convert.dit_dtype", "float64", ["convert.dit_dtype: expected one of float32, float16, got 'float64'"]),
    ("convert", "convert.allow_pickle", "no", ["convert.allow_pickle: expected true or false, got 'no'"]),
    ("convert", "model.arc", 42, ["model.arc: expected text", "got 42"]),
    ("svd", "svd.max_rank", 0, ["svd.max_rank: expected a whole number >= 1, got 0"]),
    ("svd", "svd.max_rank", "lots", ["svd.max_rank: expected a whole number >= 1, got 'lots'"]),
    ("svd", "svd.precision", "fp8", ["svd.precision: expected one of stored, float32, float16, bfloat16"]),
    ("normalize", "normalize.max_seconds", "long", ["normalize.max_seconds: expected a positive number, got 'long'"]),
    ("normalize", "normalize.max_seconds", -1, ["normalize.max_seconds: expected a positive number, got -1"]),
    ("normalize", "normalize.format", "mp3", ["normalize.format: expected one of flac, wav, got 'mp3'"]),
    ("normalize", "normalize.strict", "maybe", ["normalize.strict: expected true or false"]),
    ("normalize", "normalize.sample_rate", 12345, ["normalize.sample_rate: the codec of model.base", "44100 Hz"]),
    ("encode", "encode.chunk_latents", "abc", ["encode.chunk_latents: expected a whole number >= 1, got 'abc'"]),
    ("encode", "encode.overlap", -1, ["encode.overlap: expected a whole number >= 0, got -1"]),
    ("encode", "encode.overlap", 500, ["encode.overlap: expected a whole number in [0, chunk_latents=128)"]),
    ("encode", "encode.shard", "3/2", ["encode.shard: expected 'i/n' with 0 <= i < n, got '3/2'"]),
    ("train", "train.lr", "abc", ["train.lr: expected a positive number or null, got 'abc'"]),
    ("train", "train.batch_size", 0, ["train.batch_size: expected a whole number >= 1, got 0"]),
    ("train", "train.batch_size", 2.5, ["train.batch_size: expected a whole number >= 1, got 2.5"]),
    ("train", "train.adapter", {"adapter_type": "dora-rowz"}, ["train.adapter.adapter_type: expected one of lora,"]),
    ("train", "train.adapter", {"rnak": 4}, ["train.adapter.rnak: unknown key; known: adapt_conditioner"]),
    ("train", "train.adapter", {"include": [1]}, ["train.adapter.include: expected a list of text or null, got [1]"]),
    ("train", "train.preset", "underfit", ["train.preset: expected one of underfit-dashboard"]),
    ("train", "train.name", "../x", ["train.name: expected text matching"]),
    ("train", "train.demos", {"evry": 5}, ["train.demos.evry: unknown key"]),
    ("demo", "demo.tail_seconds", -1, ["demo.tail_seconds: expected a number >= 0, got -1"]),
    ("demo", "demo.decode_chunk", "big", ["demo.decode_chunk: expected a whole number >= 1, got 'big'"]),
    ("demo", "demo.baselines", "yes", ["demo.baselines: expected true or false, got 'yes'"]),
    ("demo", "demo.entries", [{"prompt": "x", "seconds": -1}], ["demo.entries[0]: demo entry 'x': seconds must be"]),
]


@pytest.mark.parametrize("stage, key, value, words", BAD_PARAMS, ids=[f"{c[1]}={c[2]!r}" for c in BAD_PARAMS])
def test_a_bad_param_is_one_line_and_nothing_changes(project, capsys, stage, key, value, words):
    set_param(project, key, value)
    before = snapshot(project)
    status, err = run_stage(stage, capsys)
    assert_one_line(status, err, stage, "params.yaml: ", *words)
    assert snapshot(project) == before


@pytest.mark.parametrize(
    "stage, section", [("normalize", "normalize"), ("encode", "encode"), ("train", "train"), ("svd", "svd")]
)
def test_an_unknown_key_is_named(project, capsys, stage, section):
    set_param(project, f"{section}.colour", "blue")
    before = snapshot(project)
    status, err = run_stage(stage, capsys)
    assert_one_line(status, err, stage, f"params.yaml: {section}.colour: unknown key")
    assert snapshot(project) == before


def test_params_yaml_that_is_not_yaml(project, capsys):
    (project / layout.PARAMS_FILE).write_text("train:\n  lr: [1e-4\n")
    status, err = run_stage("train", capsys)
    assert_one_line(status, err, "train", "params.yaml: line", "not valid YAML")


@pytest.mark.parametrize("text, number", [("5e-5", 5e-5), ("1E-4", 1e-4), ("1_000", 1000.0), ("3.0e-5", 3e-5)])
def test_yaml_11_numbers_are_numbers(text, number):
    assert yaml.safe_load(f"lr: {text}")["lr"] in (text, number)  # PyYAML leaves most of them as text
    assert positive().check("train.lr", yaml.safe_load(f"lr: {text}")["lr"]) == number


def test_dvc_exp_run_s_with_exponent_notation_trains_with_that_number(tmp_path):
    """`dvc exp run -S train.lr=5e-5` writes params.yaml; the train stage's params code reads 5e-05."""
    project = tmp_path / "exp"
    project.mkdir()
    shutil.copyfile(ROOT / "params.yaml", project / "params.yaml")
    train = dvc_stages(ROOT / "dvc.yaml")["train"]
    probe = (
        "from sa3mlx.runtime.params import stage_params\nfrom sa3mlx.train.job import TrainJob\n"
        "p = stage_params('train')\njob = TrainJob.from_params(p['train'], base=p['model']['base'])\n"
        "open('lr.txt', 'w').write(f'{job.cfg.lr:g}')\n"
    )
    (project / "probe.py").write_text(probe)
    stage = {"cmd": "python probe.py", "deps": ["probe.py"], "params": train["params"], "outs": ["lr.txt"]}
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": stage}}))
    init_repo(project)
    commit_all(project)
    run(["dvc", "exp", "run", "-S", "train.lr=5e-5"], project, timeout=300)
    assert (project / "lr.txt").read_text() == "5e-05"


# ---- the real entry points ---------------------------------------------------------------------------
def stage_process(stage: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "stages" / f"{stage}.py")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_stage_process_exit_status_and_debug_traceback(project):
    set_param(project, "train.lr", "abc")
    result = stage_process("train", project)
    assert result.returncode == USER_ERROR_STATUS
    assert result.stderr.splitlines() == [
        "sa3mlx: train: params.yaml: train.lr: expected a positive number or null, got 'abc'"
    ]
    debug = stage_process("train", project, {DEBUG_ENV: "1"})
    assert debug.returncode == USER_ERROR_STATUS
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.splitlines()[-1] == result.stderr.splitlines()[0]


def test_a_bug_still_shows_its_traceback_and_asks_for_a_report(capsys):
    def broken():
        return {}["missing"]

    assert guarded("train", broken) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'missing'" in err
    assert err.splitlines()[-1].startswith("sa3mlx: train: internal error (KeyError): this is a bug")
    assert "please report it" in err.splitlines()[-1]


def test_cli_user_error_is_one_line(tmp_path, capsys):
    from sa3mlx.cli import main

    missing = tmp_path / "nope" / "dit.npz"
    assert (
        main(["lora", "merge", "--base", str(missing), "--lora", str(ADAPTER), "--out", str(tmp_path / "out.npz")]) == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"sa3mlx: lora: {missing}: missing (arrays); check the path, or restore the file from where it came from"
    ]


# ---- model folders ----------------------------------------------------------------------------------
def test_missing_model_folder_says_what_it_must_hold(project, capsys):
    set_param(project, "model.base", "sa3-small-music-base")
    before = snapshot(project)
    status, err = run_stage("convert", capsys)
    assert_one_line(
        status,
        err,
        "convert",
        "models/sa3-small-music-base (model.base) does not exist",
        "model_config.json, model.safetensors, t5gemma-b-b-ul2/",
        "hf download stabilityai/stable-audio-3-small-music-base --local-dir models/sa3-small-music-base",
    )
    assert snapshot(project) == before


def test_incomplete_model_folder_lists_what_it_lacks(project, capsys):
    shutil.rmtree(project / "models" / ARC / layout.T5GEMMA_SOURCE_DIR)
    (project / "models" / ARC / layout.CHECKPOINT_FILE).unlink()
    status, err = run_stage("convert", capsys)
    assert_one_line(status, err, "convert", f"models/{ARC} (model.arc) lacks model.safetensors, t5gemma-b-b-ul2/")


def test_doctor_lists_every_problem_before_dvc(project, capsys):
    from sa3mlx.doctor import main

    assert main() == 0
    set_param(project, "model.arc", "missing-arc")
    set_param(project, "normalize.sample_rate", 48000)
    set_param(project, "train.lr", "fast")
    capsys.readouterr()
    assert main() == USER_ERROR_STATUS
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[2] for line in err] == ["convert", "normalize", "train"]
    assert "models/missing-arc (model.arc) does not exist" in err[0]
    assert "normalize.sample_rate: the codec of model.base 'tiny-base' takes 44100 Hz" in err[1]


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
