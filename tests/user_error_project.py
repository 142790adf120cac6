"""The project the user-error tests run on, and how they run a stage and read its one line.

The stages run in-process (`guarded`, as their `__main__` does) on a small project whose "computed"
outputs are real files: converted models, svd bases, latents, normalized audio, a run with a
resume state, the final adapter.
"""

from __future__ import annotations

import hashlib
import json
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml
from conftest import FIXTURES, ROOT

from sa3mlx.convert.model import convert_source
from sa3mlx.lora.bases import compute_svd_file
from sa3mlx.runtime import layout
from sa3mlx.runtime.errors import USER_ERROR_STATUS, guarded
from sa3mlx.train.resume import ResumeState, save_resume

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
