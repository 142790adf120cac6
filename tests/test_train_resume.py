"""Resume states, the fingerprint rule, bare-adapter offsets, and bit-exact continuation with the
real TrainingSession (in process, and after `kill -9` of a training subprocess)."""

import io
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_train_loop import make_loop
from test_train_loop_fake import TINY_PARAMS, FakeSession, make_tiny_project, reproducible_prompt_encoding

from sa3mlx.lora.checkpoint import save_lora
from sa3mlx.train.job import TrainJob
from sa3mlx.train.metrics import read_history
from sa3mlx.train.resume import (
    ResumeError,
    ResumeState,
    bare_offsets,
    find_resume,
    join_arrays,
    load_resume,
    prepare_run,
    resume_files,
    save_resume,
    split_arrays,
    tree_digest,
)
from sa3mlx.train.runs import list_checkpoints


@pytest.fixture(scope="module")
def tiny_project(tmp_path_factory):
    restore = reproducible_prompt_encoding()
    yield make_tiny_project(tmp_path_factory.mktemp("tiny"))
    restore()


def _job(project, root, **params):
    """A TrainJob on the tiny project's model and latents, with its run folders under `root`."""
    for sub in ("models", "data"):
        if not (root / sub).exists():
            root.mkdir(parents=True, exist_ok=True)
            (root / sub).symlink_to(project / sub)
    return TrainJob.from_params({**TINY_PARAMS, **params}, "tiny-base", root=root)


def _final_files(job):
    checkpoint = list_checkpoints(job.run_paths("x").root)[-1]
    return checkpoint, resume_files(checkpoint)[0]


# ---- the state files --------------------------------------------------------------------------


def test_state_files_roundtrip_and_stay_out_of_checkpoint_discovery(tmp_path):
    checkpoint = tmp_path / "s" / "checkpoints" / "run-step=7-epoch=1.safetensors"
    session = {
        "optimizer": {"step": np.array(7, np.uint64), "a.m": np.ones((2, 3), np.float32)},
        "schedule": {"type": "wsd", "plan": {"total_steps": 9}, "elapsed_seconds": 0.1 + 0.2},
        "counters": [1, np.float32(2.5)],
    }
    state = ResumeState(
        step=7,
        epoch=1,
        fingerprint="f",
        sampler={"epoch": 1, "position": 2},
        session=session,
        adapter={"x.lora_A": np.arange(6, dtype=np.float32).reshape(2, 3)},
        loop={"epoch_offset": 0},
    )
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"adapter")
    json_path = save_resume(checkpoint, state)
    names = sorted(p.name for p in checkpoint.parent.iterdir())
    assert names == sorted([checkpoint.name, *(p.name for p in resume_files(checkpoint))])
    assert all("step=" not in p.name and p.suffix in (".npz", ".json") for p in resume_files(checkpoint))
    assert list_checkpoints(tmp_path) == [checkpoint]
    back = load_resume(json_path)
    assert back.session["schedule"]["elapsed_seconds"] == 0.1 + 0.2  # floats survive JSON exactly
    assert back.session["optimizer"]["step"].dtype == np.uint64 and back.session["counters"][1] == np.float32(2.5)
    assert np.array_equal(back.adapter["x.lora_A"], state.adapter["x.lora_A"])
    tree, arrays = split_arrays(session, "s")
    assert join_arrays(json.loads(json.dumps(tree)), arrays)["optimizer"]["a.m"].shape == (2, 3)
    resume_files(checkpoint)[0].write_bytes(b"torn")
    with pytest.raises(ResumeError, match="do not match their hash"):
        load_resume(json_path)


def test_fingerprint_mismatch_starts_over_and_orphans_are_dropped(tmp_path):
    loop = make_loop(tmp_path, max_steps=10, checkpoint_every=5, fingerprint="key-A")
    loop.run()
    root = loop.run_paths.root
    orphan = loop.run_paths.checkpoints / "fake-run-step=15-epoch=5.safetensors"  # killed between its two files
    orphan.write_bytes(b"x")
    choice, lines = prepare_run(root, "key-A")
    assert choice.state.step == 10 and not orphan.exists()
    assert lines[0].startswith("resume: continuing from fake-run-step=10-epoch=3.safetensors (step 10")
    choice, lines = prepare_run(root, "key-B", {"config": {"lr": 2}})
    assert choice.state is None and list_checkpoints(root) == []
    assert lines[0].startswith("resume: starting over: the inputs or settings changed") and "2 checkpoints" in lines[0]
    assert prepare_run(root, "key-B") == (find_resume(root, "key-B"), [])


def test_input_digests_follow_content_not_bytecode(tmp_path):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    before = tree_digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\x00")
    assert tree_digest(tmp_path / "pkg") == before
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert tree_digest(tmp_path / "pkg") != before
    assert tree_digest(tmp_path / "missing") == "absent"


def test_bare_adapter_offsets_follow_underfits_ladder(tmp_path):
    path = tmp_path / "run-step=300-epoch=7.safetensors"
    assert bare_offsets(path, {"step": 200, "epoch": 4}, 0, None) == (0, 4)  # explicit wins, even 0
    assert bare_offsets(path, {"step": 200, "epoch": 4}) == (200, 4)  # then the metadata
    assert bare_offsets(path, {"step": 0, "epoch": 0}) == (300, 7)  # 0 falls through to the name
    assert bare_offsets(tmp_path / "seed.safetensors", {}, 250, None, steps_per_epoch=100) == (250, 2)
    assert bare_offsets(tmp_path / "seed.safetensors", {}) == (0, 0)


def test_start_from_a_bare_adapter(tmp_path):
    donor = FakeSession(seed=1)
    for layer in donor.adapters.values():
        layer.lora_B = layer.lora_B + 0.25
    seed = save_lora(tmp_path / "seed-step=40-epoch=3.safetensors", donor.adapters, donor.lora_config, 40, 3)
    loop = make_loop(tmp_path, max_steps=42)
    loop.start_from_adapter(seed)
    assert (loop.global_step, loop.epoch) == (40, 3)
    fp16 = {k: v.astype(np.float16).astype(np.float32) for k, v in donor.adapter_state().items()}
    assert all(np.array_equal(loop.session.adapter_state()[k], fp16[k]) for k in fp16)
    loop.run()
    assert "Resuming from step offset 40, epoch offset 3" in loop.out.getvalue()
    assert list_checkpoints(loop.run_paths.root)[-1].name == "fake-run-step=42-epoch=4.safetensors"


def test_wsd_budget_is_frozen_once_and_counts_across_a_resume(tmp_path):
    session = FakeSession(schedule="wsd", max_minutes=1.0)
    loop = make_loop(tmp_path, session=session, max_steps=1000, checkpoint_every=1000, max_minutes=1.0)
    loop.session.on_step = lambda s: s.calls == 5 and signal.raise_signal(signal.SIGINT)
    loop.run()
    state = find_resume(loop.run_paths.root, "").state
    plan = state.session["schedule"]["plan"]
    assert plan["total_steps"] > 100 and state.session["schedule"]["elapsed_seconds"] > 0
    assert "WSD: 1 min budget (0.0 used)" in loop.out.getvalue()
    resumed = make_loop(
        tmp_path,
        session=FakeSession(schedule="wsd", max_minutes=1.0),
        max_steps=1000,
        max_minutes=1.0,
        session_id="dddd0004",
    )
    resumed.restore(state)
    assert resumed.session.schedule.plan.total_steps == plan["total_steps"]  # not re-planned
    assert resumed.target_step() == min(1000, plan["total_steps"])


# ---- bit-exact continuation with the real session ---------------------------------------------


def test_real_session_resume_in_process_is_bit_exact(tiny_project, tmp_path):
    straight = _job(tiny_project, tmp_path / "straight")
    assert straight.run(io.StringIO()) == 0
    first = _job(tiny_project, tmp_path / "split", max_steps=5)
    first.run(io.StringIO())
    out = io.StringIO()
    assert _job(tiny_project, tmp_path / "split").run(out) == 0
    assert "resume: continuing from tiny-lora-step=5-epoch=2.safetensors" in out.getvalue()
    (a, a_arrays), (b, b_arrays) = _final_files(straight), _final_files(first)
    assert a.name == b.name == "tiny-lora-step=8-epoch=2.safetensors"
    assert a.read_bytes() == b.read_bytes() and a_arrays.read_bytes() == b_arrays.read_bytes()
    assert straight.final_adapter.read_bytes() == first.final_adapter.read_bytes() == a.read_bytes()
    assert [s for s, _ in read_history(first.metrics_dir, "train/loss")] == list(range(1, 9))


CHILD = """
import json, sys
import sa3mlx
import sa3mlx.models.prompt as prompt
prompt.ENCODE_BATCH = 1  # as reproducible_prompt_encoding() in the parent
from sa3mlx.train.job import TrainJob
sys.exit(TrainJob.from_params(json.loads(sys.argv[1]), "tiny-base", root=sys.argv[2]).run())
"""


def test_real_session_resume_after_kill_9_is_bit_exact(tiny_project, tmp_path):
    killed = _job(tiny_project, tmp_path / "killed")
    params = {**TINY_PARAMS, "max_steps": 10_000}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(params), str(killed.root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    try:
        while len(list(killed.root.glob("runs/*/*/checkpoints/resume-*.json"))) < 2:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child saved no checkpoints"
            time.sleep(0.05)
    finally:
        child.kill()  # SIGKILL: no handler runs, whatever it was doing
        child.wait()
    state = find_resume(killed.run_paths("x").root, "unused").checkpoint
    saved = load_resume(resume_files(state)[1]).step
    target = saved + 6
    out = io.StringIO()
    assert _job(tiny_project, tmp_path / "killed", max_steps=target).run(out) == 0
    assert f"(step {saved}; fingerprint" in out.getvalue()
    straight = _job(tiny_project, tmp_path / "straight", max_steps=target)
    straight.run(io.StringIO())
    (a, a_arrays), (b, b_arrays) = _final_files(straight), _final_files(killed)
    assert a.name == b.name and a.read_bytes() == b.read_bytes() and a_arrays.read_bytes() == b_arrays.read_bytes()
    steps = [s for s, _ in read_history(killed.metrics_dir, "train/loss")]
    assert steps == list(range(1, target + 1))  # the killed run's rows past its checkpoint are gone
