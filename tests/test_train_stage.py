"""The `train` stage: a real tiny run's stdout read with the dashboard's patterns, smoke mode,
the fingerprint rule through TrainJob, declared params, and `dvc repro train` in a throwaway
git+dvc copy of the project."""

import io
import json
import subprocess

import numpy as np
import pytest
import yaml
from dvc_project import commit_all, make_project, run, tool_env
from test_train_loop import parse_console
from test_train_loop_fake import TINY_PARAMS, make_tiny_project, reproducible_prompt_encoding

from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.lora.validate import validate
from sa3mlx.train import progress as P
from sa3mlx.train.job import TrainJob
from sa3mlx.train.loop import batch_inputs
from sa3mlx.train.runs import list_checkpoints


@pytest.fixture(scope="module")
def tiny_project(tmp_path_factory):
    restore = reproducible_prompt_encoding()
    yield make_tiny_project(tmp_path_factory.mktemp("tiny"))
    restore()


def _job(project, **params):
    return TrainJob.from_params({**TINY_PARAMS, **params}, "tiny-base", root=project)


def test_real_run_stdout_reads_like_underfit_for_the_dashboard(tiny_project):
    out = io.StringIO()
    assert _job(tiny_project, name="console", max_steps=8, checkpoint_every=3).run(out) == 0
    plain, steps = parse_console(out.getvalue())
    assert sorted(steps) == list(range(1, 9))  # 6 clips, batch 2: 3 batches an epoch
    assert all(total == 3 and epoch == (step - 1) // 3 for step, (epoch, total, _) in steps.items())
    final = read_lora(tiny_project / "models" / "lora" / "console.safetensors")
    trainable = sum(v.size for tensors in final.layers.values() for v in tensors.values())
    assert plain[1:6] == [
        "train: prompts: 0 of 6 training items have an empty prompt (no tags or other source)",
        "LoRA config: rank=4, alpha=4, adapter_type=dora-rows",
        plain[3],
        f"lora layers: {len(final.layers)}",
        f"Trainable LoRA params: {trainable:,}",
    ]
    assert plain[3].startswith("  exclude: ['to_timestep_embed'")
    best = tiny_project / "models" / "lora" / "console-best.safetensors"
    preview = plain.index("Prompt preview (6 samples):")
    assert plain[preview + 7 :] == [
        "Training to global step 8 (8 new steps from step_offset=0); save every 3",
        "✓ Saved checkpoint -- console-step=3-epoch=0.safetensors",
        "✓ Saved checkpoint -- console-step=6-epoch=1.safetensors",
        "✓ Saved checkpoint -- console-step=8-epoch=3.safetensors (final)",
        f"best: no candidate past the warm-up (train loss EMA 0.9); the final adapter -> {best}",
        P.TRAINING_DONE,
        f"train: final adapter {tiny_project}/models/lora/console.safetensors (= console-step=8-epoch=3.safetensors)",
    ]
    records = P.read_loss_by_timestep(tiny_project / "runs" / "console" / "demos" / P.LOSS_BY_TIMESTEP_FILE)
    assert [r[0] for r in records] == list(range(8)) and all(0 < r[1] < 1 for r in records)
    report = validate(tiny_project / "models" / "lora" / "console.safetensors")
    assert report["ok"] and report["config"]["step"] == 8 and report["config"]["epoch"] == 3
    assert best.read_bytes() == (tiny_project / "models" / "lora" / "console.safetensors").read_bytes()


def test_smoke_mode_checks_a_resume_and_leaves_the_run_alone(tiny_project):
    out = io.StringIO()
    assert _job(tiny_project, name="smoke", smoke=True).run(out) == 0
    assert "smoke: OK: resumed at step 3, 3 more steps" in out.getvalue()
    assert validate(tiny_project / "models" / "lora" / "smoke.safetensors")["config"]["step"] == 6
    assert list_checkpoints(tiny_project / "runs" / "smoke") == []


def test_longer_run_resumes_other_settings_start_over(tiny_project):
    assert _job(tiny_project, name="rule", max_steps=4).run(io.StringIO()) == 0
    out = io.StringIO()
    _job(tiny_project, name="rule", max_steps=6).run(out)
    assert "resume: continuing from rule-step=4-epoch=1.safetensors (step 4;" in out.getvalue()
    out = io.StringIO()
    _job(tiny_project, name="rule", max_steps=6, lr=5e-4).run(out)
    assert (
        "resume: starting over: the inputs or settings changed since the run's last checkpoint "
        "(config.train.lr); removed the stale run's 2 checkpoints" in out.getvalue()
    )
    (tiny_project / "data" / "latents" / "clip0.json").write_text(
        (tiny_project / "data" / "latents" / "clip0.json").read_text().replace("house", "garage")
    )
    out = io.StringIO()
    _job(tiny_project, name="rule", max_steps=7, lr=5e-4).run(out)
    assert "(inputs.data/latents)" in out.getvalue()


def test_every_param_read_must_be_declared(tmp_path):
    (tmp_path / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"train": {"cmd": "x", "params": ["model.base", "train.lr", "train.name"]}}})
    )
    with pytest.raises(ValueError, match=r"sets \['train.batch_size'\] but the train stage does not declare"):
        TrainJob.from_params({"lr": 1e-4, "name": "x", "batch_size": 2}, "tiny-base", root=tmp_path)
    with pytest.raises(ValueError, match="train.name '../x' must be"):
        TrainJob.from_params({"lr": 1e-4, "name": "../x"}, "tiny-base", root=tmp_path)


def test_dvc_repro_train_on_the_embedded_default(tmp_path):
    project = make_project(tmp_path)
    first = run(["dvc", "repro", "train"], project)
    assert "Running stage 'train'" in first and P.TRAINING_DONE in first
    params = yaml.safe_load((project / "params.yaml").read_text())["train"]
    final = project / "models" / "lora" / f"{params['name']}.safetensors"
    report = validate(final)
    assert report["ok"] and report["config"]["step"] == params["max_steps"]
    summary = json.loads((project / "dvclive" / "train" / "metrics.json").read_text())
    assert "loss" in summary["val"] and "loss" in summary["train"]  # what `dvc exp show` lists
    best = project / "models" / "lora" / f"{params['name']}-best.safetensors"
    assert validate(best)["ok"] and 0 < validate(best)["config"]["step"] <= params["max_steps"]
    assert "didn't change" in run(["dvc", "repro", "train"], project)
    text = (project / "params.yaml").read_text()
    (project / "params.yaml").write_text(
        text.replace(f"max_steps: {params['max_steps']} ", f"max_steps: {params['max_steps'] + 4} ")
    )
    again = run(["dvc", "repro", "train"], project)
    assert f"resume: continuing from {params['name']}-step={params['max_steps']}-" in again
    assert validate(final)["config"]["step"] == params["max_steps"] + 4
    assert best.is_file()  # kept across the resume (persist)
    commit_all(project)
    shown = run(["dvc", "exp", "show", "--no-pager", "--csv"], project)
    assert "val.loss" in shown.splitlines()[0].split(",")  # the val/loss column
    shown = subprocess.run(
        ["dvc", "plots", "show", "--json", "loss"], cwd=project, env=tool_env(), capture_output=True, text=True
    )
    points = json.loads(shown.stdout)["data"]["loss"][0]["content"]["data"]["values"]
    assert {p["filename"] for p in points} == {"train/loss.tsv", "val/loss.tsv"}  # the dvc.yaml `loss` plot


@pytest.mark.parametrize("override", [None, False])
def test_padded_batch_takes_the_masked_path_the_model_config_asks_for(tiny_project, monkeypatch, override):
    from sa3mlx.models.dit import DiT

    params = {} if override is None else {"mask_padding_attention": override}
    job = _job(tiny_project, name="masked", latent_crop_length=48, **params)  # longer than every clip
    assert job.model_config().mask_padding_attention  # tiny-base, as every shipped SA3 config
    expected = override is None
    source = "model config" if override is None else "train.mask_padding_attention"
    assert f"mask_padding_attention {str(expected).lower()} ({source})" in job.describe()
    session, loader = job.build()
    batch = next(loader.epoch())
    assert not batch.padding_mask.all(axis=1).any()  # every row padded
    seen = []
    forward = DiT.__call__

    def spy(self, *args, padding_mask=None, **kwargs):
        seen.append(None if padding_mask is None else padding_mask.shape)  # traced by mx.compile: no values
        return forward(self, *args, padding_mask=padding_mask, **kwargs)

    monkeypatch.setattr(DiT, "__call__", spy)
    assert session.objective.dit_padding_mask is expected and session.objective.loss_on_signal_only is expected
    assert session.step(batch_inputs(batch), np.random.default_rng(0)).finite
    assert seen
    if expected:
        assert seen == [batch.padding_mask.shape] * len(seen)
    else:
        assert seen == [None] * len(seen)


def test_config_train_prints_what_the_run_uses(tmp_path, capsys):
    import json
    import shutil

    from conftest import ROOT

    from sa3mlx.cli import main

    for name in ("params.yaml", "dvc.yaml"):
        shutil.copyfile(ROOT / name, tmp_path / name)
    (tmp_path / "models").mkdir()
    shutil.copytree(ROOT / "models" / "tiny-base", tmp_path / "models" / "tiny-base")
    assert main(["config", "train", "--root", str(tmp_path)]) == 0
    resolved = json.loads(capsys.readouterr().out)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    assert resolved["preset"] == params["preset"] and resolved["train"]["lr"] == params["lr"]
    assert resolved["train"]["mask_padding_attention"] is True  # tiny-base's config says so
    assert resolved["from_model_config"] == ["mask_padding_attention", "use_effective_length_for_schedule"]
    assert resolved["model"]["config"] == str(tmp_path / "models" / "tiny-base" / "model_config.json")
    assert resolved["validation"]["every"] == params["validation"]["every"]
    assert resolved["outputs"]["best"] == str(tmp_path / "models" / "lora" / f"{params['name']}-best.safetensors")
    text = (
        (tmp_path / "params.yaml").read_text().replace("mask_padding_attention: null", "mask_padding_attention: false")
    )
    (tmp_path / "params.yaml").write_text(text)
    assert main(["config", "train", "--root", str(tmp_path)]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["train"]["mask_padding_attention"] is False
    assert resolved["from_model_config"] == ["use_effective_length_for_schedule"]
