"""The training loop on a stand-in session: console output as the dashboard parses it,
checkpoint cadence and names, keep_last, SAVE_NOW / SIGUSR1 / SIGINT, guards, metrics."""

import io
import json
import os
import signal

import numpy as np
import pytest
from test_train_loop_fake import FakeSession, make_loader, write_latents
from test_train_progress import (
    GN_RE,
    HISTORY_RE,
    LM_RE,
    LR_RE,
    PBAR_SIG_RE,
    STATUS_LOSS_RE,
    STATUS_LR_RE,
    STATUS_RE,
    STEP_PREFIX_RE,
)

from sa3mlx.lora.validate import validate
from sa3mlx.train import progress as P
from sa3mlx.train.contract import TrainingCallback
from sa3mlx.train.guards import StallWatchdog
from sa3mlx.train.loop import LoopSettings, TrainingLoop, preview_prompts
from sa3mlx.train.metrics import SUMMARY, TrainingMetrics, read_history
from sa3mlx.train.resume import find_resume, resume_files
from sa3mlx.train.runs import RunPaths, list_checkpoints

NAME = "fake-run-20240101120000"  # a dashboard run id: the label drops the timestamp


def make_loop(tmp_path, session=None, out=None, callbacks=(), session_id="aaaa0001", **settings):
    latents = tmp_path / "latents"
    if not latents.exists():
        write_latents(latents)
    defaults = {"max_steps": 12, "checkpoint_every": 5, "seed": 3, "max_nonfinite": 3}
    run = RunPaths.create(tmp_path / "runs", NAME, session_id)
    return TrainingLoop(
        session or FakeSession(),
        make_loader(latents),
        run,
        LoopSettings(**{**defaults, **settings}),
        callbacks=callbacks,
        out=out or io.StringIO(),
    )


def parse_console(text):
    """(the plain lines, {global step: (epoch, batches per epoch, lr text)}) of a run's stdout, read
    as the dashboard reads it: each bar line must match its status and history patterns."""
    plain, steps = [], {}
    for line in text.splitlines():  # splits at tqdm's \r too, as the dashboard does
        if not line.strip():
            continue
        if not PBAR_SIG_RE.match(line):
            plain.append(line.lstrip("\r"))
            continue
        assert STATUS_RE.search(line), line
        m = HISTORY_RE.search(line)
        if m is None or m.group(2) == "0":
            assert m is not None or "train/" not in line, line
            continue
        assert STATUS_LOSS_RE.search(line) and STATUS_LR_RE.search(line) and GN_RE.search(line) and LM_RE.search(line)
        steps.setdefault(
            int(STEP_PREFIX_RE.search(line).group(1)), (int(m.group(1)), int(m.group(3)), LR_RE.search(line).group(1))
        )
    return plain, steps


def test_console_output_parses_like_the_dashboard(tmp_path):
    loop = make_loop(tmp_path)
    assert loop.run().status == "done"
    plain, steps = parse_console(loop.out.getvalue())
    # 5 clips, batch 2: 3 batches per epoch; the final save carries the next epoch (underfit)
    assert sorted(steps) == list(range(1, 13))
    assert all(total == 3 and epoch == (s - 1) // 3 for s, (epoch, total, _) in steps.items())
    assert steps[1][2] == f"{FakeSession().schedule.lr(1):.3e}"  # the lr the next step uses
    preview = preview_prompts(make_loader(tmp_path / "latents"))
    assert plain == [
        "LoRA config: rank=2, alpha=2, adapter_type=dora-rows",
        *P.lora_config_lines(loop.session.lora_config)[1:],
        "lora layers: 2",
        "Trainable LoRA params: 80",
        *P.prompt_preview_lines(preview),
        "Training to global step 12 (12 new steps from step_offset=0); save every 5",
        "✓ Saved checkpoint -- fake-run-step=5-epoch=1.safetensors",
        "✓ Saved checkpoint -- fake-run-step=10-epoch=3.safetensors",
        "✓ Saved checkpoint -- fake-run-step=12-epoch=4.safetensors (final)",
        "Training done",
    ]
    trained = [p for batch in make_loader(tmp_path / "latents").epoch() for p in batch.prompts]
    assert preview == trained  # the preview shows the prompts the first draws get
    records = P.read_loss_by_timestep(loop.run_paths.demos / P.LOSS_BY_TIMESTEP_FILE)
    assert [r[0] for r in records] == list(range(12))
    names = [p.name for p in list_checkpoints(loop.run_paths.root)]
    assert names == [
        "fake-run-step=5-epoch=1.safetensors",
        "fake-run-step=10-epoch=3.safetensors",
        "fake-run-step=12-epoch=4.safetensors",
    ]
    for path in list_checkpoints(loop.run_paths.root):
        assert path.parent == tmp_path / "runs" / NAME / "aaaa0001" / "checkpoints"
        assert validate(path)["ok"]
        assert all(f.is_file() and "step=" not in f.name and f.suffix != ".safetensors" for f in resume_files(path))


def test_keep_last_prunes_checkpoints_and_their_states(tmp_path):
    seen = []

    class Saves(TrainingCallback):
        def on_checkpoint(self, path, step, epoch):
            seen.append((step, path.is_file(), resume_files(path)[1].is_file()))

    loop = make_loop(tmp_path, max_steps=20, checkpoint_every=3, keep_last=2, callbacks=[Saves()])
    loop.run()
    assert seen == [(s, True, True) for s in (3, 6, 9, 12, 15, 18, 20)]  # callbacks run after the save
    kept = list_checkpoints(loop.run_paths.root)
    assert [p.name for p in kept] == ["fake-run-step=18-epoch=5.safetensors", "fake-run-step=20-epoch=7.safetensors"]
    states = sorted(p.name for p in loop.run_paths.checkpoints.glob("resume-*"))
    assert states == sorted(f.name for p in kept for f in resume_files(p))


def test_in_process_resume_is_bit_exact(tmp_path):
    straight = make_loop(tmp_path / "a", max_steps=11)
    straight.run()
    first = make_loop(tmp_path / "b", max_steps=4)
    first.run()
    choice = find_resume(first.run_paths.root, "")
    assert choice.state.step == 4
    resumed = make_loop(tmp_path / "b", max_steps=11, session_id="bbbb0002")
    resumed.restore(choice.state, choice.checkpoint)
    resumed.run()
    assert "Resuming from step offset 4, epoch offset 1" in resumed.out.getvalue()
    a, b = straight.last_checkpoint, resumed.last_checkpoint
    assert a.name == b.name == "fake-run-step=11-epoch=4.safetensors"
    assert a.read_bytes() == b.read_bytes()
    assert resume_files(a)[0].read_bytes() == resume_files(b)[0].read_bytes()
    lbt = [r[0] for r in P.read_loss_by_timestep(resumed.run_paths.demos / P.LOSS_BY_TIMESTEP_FILE)]
    assert lbt == list(range(11))


def test_save_now_file_and_sigusr1_save_after_the_step(tmp_path):
    def request(session):
        if session.calls == 2:
            (tmp_path / "runs" / NAME / "SAVE_NOW").touch()
        if session.calls == 7:
            os.kill(os.getpid(), signal.SIGUSR1)

    loop = make_loop(tmp_path, session=FakeSession(on_step=request), max_steps=9, checkpoint_every=100)
    loop.run()
    steps = [int(p.name.split("step=")[1].split("-")[0]) for p in list_checkpoints(loop.run_paths.root)]
    assert steps == [2, 7, 9]
    assert not (tmp_path / "runs" / NAME / "SAVE_NOW").exists()
    assert P.SAVE_REQUESTED in loop.out.getvalue()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_saves_and_stops_cleanly(tmp_path, sig):
    loop = make_loop(
        tmp_path,
        session=FakeSession(on_step=lambda s: s.calls == 4 and os.kill(os.getpid(), sig)),
        max_steps=50,
        checkpoint_every=100,
    )
    result = loop.run()
    assert (result.status, result.step, result.exit_code) == ("interrupted", 4, 128 + sig)
    assert result.checkpoint.name == "fake-run-step=4-epoch=1.safetensors"
    assert find_resume(loop.run_paths.root, "").state.step == 4
    assert "Training done" not in loop.out.getvalue()
    assert signal.getsignal(sig) is not None and signal.getsignal(sig) != loop  # handlers restored


def test_nonfinite_guard_counts_then_stops_with_the_last_good_adapter(tmp_path):
    session = FakeSession(nan_steps={3, 6, 7, 8})
    loop = make_loop(tmp_path, session=session, max_steps=30, checkpoint_every=100, max_nonfinite=3)
    result = loop.run()
    text = loop.out.getvalue()
    assert (result.status, result.step, result.exit_code) == ("nonfinite", 8, 3)
    assert "[guard] non-finite loss (nan) at step 3: update skipped (1 in a row" in text
    assert "[guard] stopping: 3 non-finite losses in a row (steps 6-8)" in text
    assert session.k == 4  # 8 steps, 4 skipped updates
    state = find_resume(loop.run_paths.root, "").state
    after_step5 = make_loop(tmp_path / "ref", session=FakeSession(nan_steps={3}), max_steps=5)
    after_step5.run()
    good = find_resume(after_step5.run_paths.root, "").state.adapter
    assert all(np.array_equal(state.adapter[k], good[k]) for k in good)
    assert [r[0] for r in P.read_loss_by_timestep(loop.run_paths.demos / P.LOSS_BY_TIMESTEP_FILE)] == [0, 1, 3, 4]


def test_stall_watchdog_warns_over_ten_times_the_median():
    dog = StallWatchdog(10.0)
    assert [dog.update(i, 0.2) for i in range(1, 7)] == [None] * 6
    assert dog.update(7, 1.9) is None
    assert dog.update(8, 3.0).startswith("[watchdog] step 8 took 3.00 s, 15x the median 0.200 s")
    tiny = StallWatchdog(10.0)
    assert [tiny.update(i, 0.001) for i in range(1, 7)] + [tiny.update(7, 0.5)] == [None] * 7  # under a second


def test_metrics_history_survives_a_resume(tmp_path):
    folder = tmp_path / "dvclive"
    first = make_loop(tmp_path, callbacks=[TrainingMetrics(folder)], max_steps=6, checkpoint_every=3)
    first.session.on_step = lambda s: s.calls == 5 and os.kill(os.getpid(), signal.SIGINT)
    first.run()  # saved at 3, logged 4 and 5, stopped (and saved) at 5
    assert [s for s, _ in read_history(folder, "train/loss")] == [1, 2, 3, 4, 5]
    state = find_resume(first.run_paths.root, "")
    checkpoint_3 = [p for p in list_checkpoints(first.run_paths.root) if "step=3-" in p.name][0]
    from sa3mlx.train.resume import load_resume

    resumed = make_loop(
        tmp_path, callbacks=[TrainingMetrics(folder, resume_step=3)], max_steps=6, session_id="cccc0003"
    )
    resumed.restore(load_resume(resume_files(checkpoint_3)[1]), checkpoint_3)
    assert state.state.step == 5
    resumed.run()
    history = read_history(folder, "train/loss")
    assert [s for s, _ in history] == list(range(1, 7))
    assert [s for s, _ in read_history(folder, "train/prompt_cache_hit_rate")] == list(range(1, 7))
    assert (folder / "metrics.json").is_file()


def test_a_resume_rebuilds_a_torn_or_stale_dvclive_summary(tmp_path):
    """A kill -9 while dvclive writes metrics.json (not atomically) leaves it torn; the summary of a
    resumed run is rebuilt from the plot files as truncated to its checkpoint."""
    folder = tmp_path / "dvclive"
    with TrainingMetrics(folder) as metrics:
        for step in range(1, 6):
            metrics.log(step, {"train/loss": 10.0 - step, "train/lr": 0.1 * step})
        metrics.log(4, {"val/loss": 0.25})
    (folder / SUMMARY).write_text('{\n    "train": {\n        "lo')  # torn mid-write
    with TrainingMetrics(folder, resume_step=3) as resumed:
        rebuilt = json.loads((folder / SUMMARY).read_text())
        assert rebuilt == {"train": {"loss": 7.0, "lr": 0.1 * 3}, "step": 3}  # val/loss was logged past step 3
        resumed.log(4, {"train/loss": 1.5, "train/lr": 0.4})
    assert read_history(folder, "train/loss") == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 1.5)]
    assert json.loads((folder / SUMMARY).read_text())["train"] == {"loss": 1.5, "lr": 0.4}


def test_the_session_contract_and_one_callback_interface(tmp_path):
    from dataclasses import FrozenInstanceError

    from sa3mlx.train.contract import Session

    assert isinstance(FakeSession(), Session)
    events = []

    class Record(TrainingCallback):
        def on_run_start(self, step, fresh):
            events.append(("start", step, fresh))

        def on_step(self, report):
            events.append(("step", report.step, report.checkpoint and report.checkpoint.name, report.stopping))

        def on_checkpoint(self, path, step, epoch):
            events.append(("saved", step, epoch))

        def on_run_end(self, status, step, checkpoint):
            events.append(("end", status, step, checkpoint.name))

    session = FakeSession(on_step=lambda s: s.calls == 5 and os.kill(os.getpid(), signal.SIGINT))
    loop = make_loop(tmp_path, session=session, max_steps=7, checkpoint_every=2, callbacks=[Record()])
    assert loop.run().status == "interrupted"
    name = "fake-run-step={}-epoch={}.safetensors"
    assert events == [
        ("start", 0, True),
        ("step", 1, None, False),
        ("step", 2, name.format(2, 0), False),
        ("saved", 2, 0),
        ("step", 3, None, False),
        ("step", 4, name.format(4, 1), False),
        ("saved", 4, 1),
        ("step", 5, name.format(5, 1), True),
        ("saved", 5, 1),
        ("end", "interrupted", 5, name.format(5, 1)),
    ]
    events.clear()
    resumed = make_loop(tmp_path, max_steps=7, checkpoint_every=2, callbacks=[Record()], session_id="eeee0005")
    resumed.restore(find_resume(resumed.run_paths.root, "").state)
    resumed.run()
    assert events[0] == ("start", 5, False) and events[-3:] == [
        ("step", 7, name.format(7, 3), False),
        ("saved", 7, 3),
        ("end", "done", 7, name.format(7, 3)),
    ]
    with pytest.raises(FrozenInstanceError):
        resumed.settings.max_steps = 9


def test_a_wall_clock_limit_ends_the_run_through_the_budget(tmp_path):
    import time

    session = FakeSession(on_step=lambda s: s.calls == 3 and time.sleep(0.7))
    loop = make_loop(tmp_path, session=session, max_steps=50, checkpoint_every=100, max_minutes=0.01)
    result = loop.run()
    assert (result.status, result.step) == ("done", 3) and loop.settings.max_steps == 50
    assert "max_minutes (0.01) reached at step 3" in loop.out.getvalue()
    assert result.checkpoint.name == "fake-run-step=3-epoch=1.safetensors"
