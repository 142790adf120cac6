"""How the whole pipeline behaves under real `dvc` on the embedded default: what reruns after each
kind of change, the run-cache, interrupted runs, experiments, and the params audit.

One project is reproduced once for the module (`base`); each test that changes something works on
its own copy (`fork`). Which stages ran is read from DVC's `Running stage '…'` lines (commands it
executed) and `Stage '…' is cached` lines (outputs restored from the run-cache, nothing executed).
"""

import csv
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml
from dvc_project import commit_all, fork, make_project, ran_stages, restored_stages, run, tool_env

from sa3mlx.runtime.params import AUDIT_ENV, declared_params

STAGES = ["convert", "svd", "normalize", "encode", "train", "demo"]  # dvc.yaml, in the order DVC runs them
UP_TO_DATE = "Data and pipelines are up to date."
RATE = 44100


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The project reproduced once (params audit on) and committed; `.first` holds that run's output."""
    root = tmp_path_factory.mktemp("behaviour")
    project = make_project(root / "base")
    audit = root / "audit"
    first = run(["dvc", "repro"], project, env={AUDIT_ENV: str(audit)})
    commit_all(project, "reproduced")
    return {"path": project, "first": first, "audit": audit}


@pytest.fixture
def work(base, tmp_path):
    return fork(base["path"], tmp_path / "work")


def params_of(project: Path) -> dict:
    return yaml.safe_load((project / "params.yaml").read_text())


def set_param(project: Path, key: str, value) -> None:
    params = params_of(project)
    *sections, name = key.split(".")
    node = params
    for section in sections:
        node = node[section]
    node[name] = value
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def digests(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def final_adapter(project: Path) -> Path:
    return project / "models" / "lora" / f"{params_of(project)['train']['name']}.safetensors"


def write_noise(path: Path, seconds: float, seed: int) -> None:
    audio = 0.1 * np.random.default_rng(seed).standard_normal((int(seconds * RATE), 2)).astype(np.float32)
    sf.write(path, audio, RATE, subtype="FLOAT")


def encode_counts(output: str) -> tuple[int, int]:
    match = re.search(r"Done in .+?: (\d+) encoded, (\d+) skipped, 0 errors", output)
    assert match, output
    return int(match.group(1)), int(match.group(2))


# ---- first run, no-op, params audit -----------------------------------------------------------------


def test_first_repro_runs_all_six_stages_and_the_second_none(base):
    with open(base["path"] / "dvc.yaml") as f:
        assert sorted(yaml.safe_load(f)["stages"]) == sorted(STAGES)
    assert ran_stages(base["first"]) == STAGES
    for name in ("tiny-base", "tiny-arc"):
        with np.load(base["path"] / "models" / "converted" / name / "dit.npz") as f:
            assert len(f.files) == 63
    second = run(["dvc", "repro"], base["path"])
    assert ran_stages(second) == [] and restored_stages(second) == []
    assert UP_TO_DATE in run(["dvc", "status"], base["path"])


def test_every_stage_reads_exactly_the_params_it_declares(base):
    for stage in STAGES:
        record = json.loads((base["audit"] / f"{stage}.json").read_text())
        declared = set(record["declared"])
        assert declared == set(declared_params(stage, base["path"] / "dvc.yaml")), stage
        read = set(record["read"])
        unread = sorted(d for d in declared if not any(r == d or r.startswith(d + ".") for r in read))
        undeclared = sorted(r for r in read if not any(r == d or r.startswith(d + ".") for d in declared))
        assert not unread, f"stage {stage} declares params it never reads: {unread}"
        assert not undeclared, f"stage {stage} read params it does not declare: {undeclared}"


# ---- what a change reruns, and the run-cache --------------------------------------------------------


def test_train_lr_reruns_train_and_demo_and_train_never_uses_the_run_cache(base, work):
    original = final_adapter(work).read_bytes()
    lr = params_of(work)["train"]["lr"]
    set_param(work, "train.lr", lr * 2)
    changed = run(["dvc", "repro"], work)
    assert ran_stages(changed) == ["train", "demo"]
    assert "resume: starting over" in changed and "(config.train.lr)" in changed  # the finished run is stale
    assert final_adapter(work).read_bytes() != original
    set_param(work, "train.lr", lr)
    back = run(["dvc", "repro"], work)
    # train has `persist` outputs, so DVC never restores it from the run-cache: it runs again, starts over
    # (its checkpoints are of the other lr), and being deterministic rewrites the original adapter; demo's
    # inputs are then those of the first run, and demo comes back from the run-cache without rendering.
    assert ran_stages(back) == ["train"] and restored_stages(back) == ["demo"]
    assert final_adapter(work).read_bytes() == original
    assert digests(work / "demos") == digests(base["path"] / "demos")
    assert UP_TO_DATE in run(["dvc", "status"], work)


def test_a_demo_param_reruns_only_demo_and_reverting_restores_it_from_the_run_cache(base, work):
    set_param(work, "demo.wav", True)
    changed = run(["dvc", "repro"], work)
    assert ran_stages(changed) == ["demo"]
    assert list((work / "demos").rglob("*.wav"))
    set_param(work, "demo.wav", False)
    back = run(["dvc", "repro"], work)
    assert ran_stages(back) == [] and restored_stages(back) == ["demo"]
    assert digests(work / "demos") == digests(base["path"] / "demos")


def test_an_encode_param_reruns_encode_train_and_demo(base, work):
    set_param(work, "encode.chunk_above_seconds", 0)  # every file in chunks of 16 latents: new latents
    set_param(work, "encode.chunk_latents", 16)
    set_param(work, "encode.overlap", 4)
    out = run(["dvc", "repro"], work)
    assert ran_stages(out) == ["encode", "train", "demo"]
    assert encode_counts(out) == (8, 0)
    assert "resume: starting over" in out and "inputs.data/latents" in out


def test_an_encode_param_that_leaves_the_latents_alike_stops_at_train(base, work):
    # Every embedded file is under 25 s, so moving the chunking threshold from 30 s to 25 s changes
    # no latent: encode reruns (its params changed) and rewrites only data/latents/details.json (which
    # records the options); that changes the folder's hash, so train reruns too, starts over
    # (its inputs changed) and, deterministic, writes the same adapter: DVC then skips demo.
    set_param(work, "encode.chunk_above_seconds", 25)
    out = run(["dvc", "repro"], work)
    assert ran_stages(out) == ["encode", "train"] and "Stage 'demo' didn't change" in out
    changed = {
        k for k, v in digests(work / "data" / "latents").items() if digests(base["path"] / "data" / "latents")[k] != v
    }
    assert changed == {"details.json"}
    assert final_adapter(work).read_bytes() == final_adapter(base["path"]).read_bytes()


def test_adding_one_audio_file_reruns_normalize_encode_train_demo(base, work):
    write_noise(work / "data" / "raw" / "added.wav", 3.0, seed=5)
    out = run(["dvc", "repro"], work)
    assert ran_stages(out) == ["normalize", "encode", "train", "demo"]
    before, after = digests(base["path"] / "data" / "normalized"), digests(work / "data" / "normalized")
    assert {k: after[k] for k in before if k != "report.json"} == {
        k: v for k, v in before.items() if k != "report.json"
    }
    assert set(after) - set(before) == {"added.wav", "added.json"}
    assert encode_counts(out) == (1, 8)
    assert "resume: starting over" in out and "inputs.data/latents" in out
    assert UP_TO_DATE in run(["dvc", "status"], work)


# ---- interrupted runs ------------------------------------------------------------------------------


def start_repro(project: Path, *targets: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """`dvc repro` in its own process group, so one SIGKILL takes DVC and the stage command down."""
    return subprocess.Popen(
        ["dvc", "repro", *targets],
        cwd=project,
        env=tool_env(),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_killed_encode_resumes_with_the_files_it_had_finished(base, work):
    extras = [f"aa_extra_{i}" for i in range(4)]  # sorted first: encoded before the embedded files
    for i, name in enumerate(extras):
        write_noise(work / "data" / "raw" / f"{name}.wav", 40.0, seed=10 + i)
    cache = work / "data" / "encode_cache"
    entries_before = len(list(cache.rglob("*.npy")))
    proc = start_repro(work, "encode")
    for line in proc.stdout:
        if re.match(rf"\[\d+/\d+\] {extras[0]}\.wav: encoded", line):
            kill(proc)
            break
    else:
        pytest.fail("encode finished before it could be killed")
    finished = len(list(cache.rglob("*.npy"))) - entries_before
    assert 1 <= finished < len(extras)
    assert "encode" in run(["dvc", "status", "encode"], work)  # not recorded in dvc.lock: it reruns
    out = run(["dvc", "repro", "encode"], work)  # the killed DVC left its pid in .dvc/tmp/rwlock: ignored
    assert ran_stages(out) == ["encode"]
    assert encode_counts(out) == (len(extras) - finished, 8 + finished)  # only the unfinished files
    latents, reference = digests(work / "data" / "latents"), digests(base["path"] / "data" / "latents")
    assert {k: latents[k] for k in reference if k != "details.json"} == {
        k: v for k, v in reference.items() if k != "details.json"
    }
    assert {f"{name}.npy" for name in extras} <= set(latents)


def test_killed_train_resumes_from_its_last_checkpoint_and_ends_as_an_uninterrupted_run(base, work):
    name, every = params_of(work)["train"]["name"], params_of(work)["train"]["checkpoint_every"]
    run_dir = work / "runs" / name
    for path in run_dir.iterdir():  # train from scratch: drop the finished run and its adapter
        if path.is_dir():
            shutil.rmtree(path)
    final_adapter(work).unlink()
    with open(work.parent / "killed.log", "w") as log:
        proc = start_repro(work, stdout=log)
        committed = []
        while proc.poll() is None and not committed:  # a checkpoint counts once its resume json exists
            time.sleep(0.01)
            committed = list(run_dir.glob("*/checkpoints/resume-*.json"))
        kill(proc)
    assert committed, "train finished before it could be killed"
    # the committed states (an adapter written just before the kill, without its state, does not count)
    steps = sorted(json.loads(p.read_text())["step"] for p in run_dir.glob("*/checkpoints/resume-*.json"))
    assert steps and steps[-1] % every == 0
    out = run(["dvc", "repro"], work)
    assert ran_stages(out) == ["train"]  # same adapter bytes as before: demo did not change
    assert f"resume: continuing from {name}-step={steps[-1]}-" in out  # lost less than one interval
    assert final_adapter(work).read_bytes() == final_adapter(base["path"]).read_bytes()
    assert UP_TO_DATE in run(["dvc", "status"], work)


# ---- experiments -----------------------------------------------------------------------------------


def exp_rows(work: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(run(["dvc", "exp", "show", "--csv"], work))))


def test_two_temp_experiments_differ_only_in_the_param_each_sets(base, work):
    """The README's recipe: `--temp` keeps the workspace params, so the second run does not inherit the first's."""
    lr, rank = params_of(work)["train"]["lr"], params_of(work)["train"]["adapter"]["rank"]
    out = run(["dvc", "exp", "run", "--temp", "-n", "lr-x2", "-S", f"train.lr={lr * 2}"], work)
    assert ran_stages(out) == ["train", "demo"]
    assert params_of(work) == params_of(base["path"])  # the workspace is untouched
    run(["dvc", "exp", "run", "--temp", "-n", "rank-x2", "-S", f"train.adapter.rank={rank * 2}"], work)
    rows = {r["Experiment"]: r for r in exp_rows(work)}
    first, second = rows["lr-x2"], rows["rank-x2"]
    # the metric train.lr (dvclive) and the param train.lr share a name: DVC prefixes both with their file
    assert float(first["params.yaml:train.lr"]) == lr * 2 and int(first["train.adapter.rank"]) == rank
    assert float(second["params.yaml:train.lr"]) == lr and int(second["train.adapter.rank"]) == rank * 2
    assert float(first["dvclive/train/metrics.json:train.lr"]) > 0
    assert int(first["step"]) == params_of(work)["train"]["max_steps"]
    baseline = next(r for r in exp_rows(work) if r["typ"] == "baseline" and r["rev"] != "workspace")
    assert np.isfinite(float(first["train.loss"])) and float(first["train.loss"]) != float(baseline["train.loss"])


# ---- the user's shell: bytecode, the CLI, pytest in the same tree ------------------------------------

USER_SHELL = {"PYTHONDONTWRITEBYTECODE": None}  # Python writes __pycache__/ as it does for every user


def test_bytecode_cli_and_pytest_in_the_tree_leave_the_pipeline_up_to_date(base, work):
    user = {**USER_SHELL, "PYTHONPATH": str(work)}  # the tree's own package runs, as with an editable install
    first = run(["dvc", "repro"], work, env=user)
    assert ran_stages(first) == []
    run(["sa3mlx", "--help"], work, env=user)
    run(
        [sys.executable, "-c", "import sa3mlx.cli, sa3mlx.train.job, sa3mlx.sample.render, sa3mlx.parity.run"],
        work,
        env=user,
    )
    (work / "tests").mkdir()
    (work / "tests" / "test_import.py").write_text("import sa3mlx.data.dataset\n\ndef test_import():\n    pass\n")
    run([sys.executable, "-m", "pytest", "-q", "tests"], work, env=user)
    assert list(work.glob("sa3mlx/**/__pycache__")) and (work / ".pytest_cache").is_dir()
    assert UP_TO_DATE in run(["dvc", "status"], work, env=user)
    second = run(["dvc", "repro"], work, env=user)
    assert ran_stages(second) == [] and restored_stages(second) == []


def test_a_run_under_another_name_edits_no_tracked_file(base, work):
    set_param(work, "train.name", "other-run")
    commit_all(work, "another run name")
    run(["dvc", "repro", "train"], work, env=USER_SHELL)
    run(["dvc", "plots", "show"], work, env=USER_SHELL)
    assert (work / "dvc_plots").is_dir() and (work / "runs" / "other-run").is_dir()
    changed = run(["git", "status", "--porcelain", "--untracked-files=all"], work).splitlines()
    outputs_meant_for_git = ("dvc.lock", "dvclive/train/")  # the lock and the cache: false metrics
    assert [line for line in changed if not any(o in line for o in outputs_meant_for_git)] == []
