"""Validation loss (`train.validation`), the best checkpoint (`train.best`) and the prompt census:
a deterministic held-out split kept out of training, the same values for the same adapter, a run
bit-exact with validation on (own folder) or off, val/loss in dvclive, the best file by val loss
or by the EMA of the training loss, kept across a resume, and the empty-prompt guard."""

import io
import json
import math

import pytest
from test_train_loop import parse_console
from test_train_loop_fake import TINY_PARAMS, make_tiny_project, reproducible_prompt_encoding

from sa3mlx.data.dataset import find_latents
from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.lora.validate import validate
from sa3mlx.train.best import LossEMA
from sa3mlx.train.job import TrainJob
from sa3mlx.train.metrics import read_history
from sa3mlx.train.runs import list_checkpoints
from sa3mlx.train.validation import ValidationSettings, per_t_metric

VALIDATION = {"every": 2, "fraction": 0.34, "timesteps": [0.25, 0.75], "batch_size": 1}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    restore = reproducible_prompt_encoding()
    yield make_tiny_project(tmp_path_factory.mktemp("validation"))
    restore()


def _job(project, **params):
    return TrainJob.from_params(
        {**TINY_PARAMS, "max_steps": 6, "checkpoint_every": 3, **params}, "tiny-base", root=project
    )


def _run(project, **params) -> tuple[TrainJob, str]:
    job, out = _job(project, **params), io.StringIO()
    assert job.run(out) == 0, out.getvalue()
    return job, out.getvalue()


def test_split_is_deterministic_and_kept_out_of_training(project):
    files = find_latents(project / "data" / "latents")
    settings = ValidationSettings.from_params(VALIDATION)
    train, held = settings.split(files, seed=5)
    assert len(held) == 2 and settings.split(files, seed=5) == (train, held)
    assert sorted(f.relpath for f in train + held) == sorted(f.relpath for f in files)
    _, loader = _job(project, validation=VALIDATION).build()
    assert {f.relpath for f in loader.dataset.files} == {f.relpath for f in train}
    assert ValidationSettings.from_params({"every": 0}).split(files, 5) == (files, [])
    with pytest.raises(ValueError, match="leaves none to train on"):
        ValidationSettings.from_params({"every": 1, "fraction": 0.99}).split(files, 5)
    with pytest.raises(ValueError, match="unknown key"):
        ValidationSettings.from_params({"evry": 1})


def test_validation_values_are_reproducible_and_best_follows_them(project):
    first, text = _run(project, name="val-a", validation=VALIDATION)
    history = read_history(first.metrics_dir, "val/loss")
    assert [s for s, _ in history] == [0, 2, 4, 6]
    assert "validation: 2 files x 2 timesteps every 2 steps" in text
    for t in (0.25, 0.75):
        assert [s for s, _ in read_history(first.metrics_dir, per_t_metric(t))] == [0, 2, 4, 6]
    lines = [line for line in text.splitlines() if line.startswith("validation at step")]
    assert len(lines) == 4
    plain, steps = parse_console(text)  # the dashboard still reads every bar line
    assert sorted(steps) == list(range(1, 7)) and lines == [p for p in plain if p.startswith("validation at")]
    again = io.StringIO()
    third = _job(project, name="val-c", validation=VALIDATION)
    assert third.run(again) == 0
    assert [line for line in again.getvalue().splitlines() if line.startswith("validation at step")] == lines
    assert read_history(third.metrics_dir, "val/loss") == history  # the same values, to the last digit
    values = {s: v for s, v in history}
    per_t = [dict(read_history(first.metrics_dir, per_t_metric(t))) for t in (0.25, 0.75)]
    assert all(math.isclose(values[s], (per_t[0][s] + per_t[1][s]) / 2, rel_tol=1e-6) for s in values)
    best_step = min((s for s in values if s > 0), key=values.get)
    best = read_lora(third.best_adapter)
    assert validate(third.best_adapter)["ok"] and best.config["step"] == best_step
    assert f"best: step {best_step} (val/loss {values[best_step]:.6f})" in again.getvalue()


def test_validation_reads_only_a_run_is_bit_exact_with_it_on_or_off(project):
    on, _ = _run(project, name="val-own", validation={**VALIDATION, "folder": "data/latents"})
    off, _ = _run(project, name="val-off")
    assert on.final_adapter.read_bytes() == off.final_adapter.read_bytes()
    assert [s for s, _ in read_history(on.metrics_dir, "train/loss")] == list(range(1, 7))


def test_best_by_the_loss_ema_survives_a_resume(project):
    best = {"smoothing": 0.5, "warmup": 2}
    straight, _ = _run(project, name="ema-a", max_steps=9, checkpoint_every=2, best=best)
    losses = [v for _, v in read_history(straight.metrics_dir, "train/loss")]
    ema, by_step = LossEMA(0.5), {}
    for step, loss in enumerate(losses, 1):
        ema.update(loss)
        if step % 2 == 0 and step >= 2 or step == 9:
            by_step[step] = ema.corrected
    chosen = min(by_step, key=by_step.get)
    assert read_lora(straight.best_adapter).config["step"] == chosen
    saved = next(p for p in list_checkpoints(straight.run_paths("x").root) if f"step={chosen}-" in p.name)
    assert straight.best_adapter.read_bytes() == saved.read_bytes()

    split, _ = _run(project, name="ema-b", max_steps=5, checkpoint_every=2, best=best)
    resumed, text = _run(project, name="ema-b", max_steps=9, checkpoint_every=2, best=best)
    assert "resume: continuing from ema-b-step=5" in text
    assert read_lora(resumed.best_adapter).config["step"] == chosen
    a, b = read_lora(straight.best_adapter), read_lora(resumed.best_adapter)
    assert all((a.layers[n][p] == b.layers[n][p]).all() for n in a.layers for p in a.layers[n])


def test_ema_maths():
    ema = LossEMA(0.5)
    assert math.isnan(ema.corrected)
    ema.update(4.0)
    assert ema.corrected == 4.0
    ema.update(float("nan"))  # skipped steps do not count
    ema.update(2.0)
    assert ema.count == 2 and ema.corrected == pytest.approx((0.5 * 2 + 0.5 * 2) / 0.75)


def test_empty_prompts_are_counted_warned_and_fail_when_strict(project, tmp_path):
    import shutil

    root = tmp_path / "p"
    shutil.copytree(project / "data", root / "data")
    (root / "models").symlink_to(project / "models")
    for i in range(4):
        sidecar = root / "data" / "latents" / f"clip{i}.json"
        info = json.loads(sidecar.read_text())
        info.pop("prompt"), info.pop("genre")
        sidecar.write_text(json.dumps(info))
    _, text = _run(root, name="empty", max_steps=1)
    assert "train: prompts: 4 of 6 training items have an empty prompt" in text
    assert "train: WARNING: more than half of the training items (4 of 6" in text
    with pytest.raises(ValueError, match="train.strict: more than half"):
        _job(root, name="empty-strict", max_steps=1, strict=True).run(io.StringIO())
    _, text = _run(root, name="paths", max_steps=1, prompts={"use_tags": True, "use_paths": True})
    assert "train: prompts: 0 of 6 training items have an empty prompt" in text and "WARNING" not in text
