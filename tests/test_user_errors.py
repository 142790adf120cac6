"""Issue 19: every bad param is one `sa3mlx: <stage>: <message>` line naming the key (and the fix),
exit status 2, no traceback, nothing computed changed; the real entry points and model folders too.
A few runs go through `python stages/<x>.py` and `dvc exp run -S`. Damaged artifacts:
test_damaged_artifacts.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from dvc_project import commit_all, init_repo, run
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

from sa3mlx.runtime import layout
from sa3mlx.runtime.errors import DEBUG_ENV, USER_ERROR_STATUS, guarded
from sa3mlx.runtime.params import dvc_stages
from sa3mlx.runtime.schema import positive

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
