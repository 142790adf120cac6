"""Data-parallel training on 2 local CPU ranks (ring back-end, tiny model, few steps): the 2-rank run
is bit for bit the 1-rank run with grad_accum 2 and matches the plain 1-rank run, rank 0 alone writes,
kill -9 of a rank stops the run and a rerun resumes bit-exactly, another world size resumes (not
bit-exact, said so), mismatched ranks stop, and the launch, settings and watchdog on their own."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from dp_compare import eps_scale_elements, identical, psnr_by_tensor
from dp_rank import launch, run_launch
from dvc_project import make_project, run
from test_train_loop import parse_console
from test_train_loop_fake import TINY_PARAMS, make_tiny_project, reproducible_prompt_encoding

from sa3mlx.lora.validate import validate
from sa3mlx.train import distributed as D
from sa3mlx.train import progress as P
from sa3mlx.train.job import TrainJob
from sa3mlx.train.metrics import read_history
from sa3mlx.train.resume import load_resume, resume_files
from sa3mlx.train.runs import list_checkpoints

STEPS, EVERY = 10, 5
DP = {"ranks": 2, "timeout": 300}  # a cold MLX kernel cache makes the first step slow
# TINY_PARAMS' seed (the "dp" run) and two more: of seeds 0-9 (bench/dp_consistency.py), 5 and 9 are the
# two where an element's first gradient is below AdamW's eps, 0 one where none is (tests/dp_compare.py)
SEEDS = (TINY_PARAMS["seed"], 0, 9)


def scratch_folders() -> set:
    return set(Path(tempfile.gettempdir()).glob("sa3mlx-rank*"))


def dp_params(name, **extra):
    return {
        **TINY_PARAMS,
        "name": name,
        "max_steps": STEPS,
        "checkpoint_every": EVERY,
        "distributed": DP,
        **extra,
    }


def state_at(project, name, step):
    [checkpoint] = [c for c in list_checkpoints(project / "runs" / name) if f"-step={step}-" in c.name]
    return checkpoint, load_resume(resume_files(checkpoint)[1])


def single(project, name, **extra):
    out = io.StringIO()
    params = dp_params(name, distributed={"ranks": 1}, **extra)
    assert TrainJob.from_params(params, "tiny-base", root=project).run(out) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    restore = reproducible_prompt_encoding()
    root = make_tiny_project(tmp_path_factory.mktemp("dp"))
    scratch_before = scratch_folders()
    code, out, err = run_launch(root, dp_params("dp"))
    assert code == 0, err
    yield root, out, scratch_folders() - scratch_before
    restore()


def test_two_ranks_match_one_rank_and_only_rank_0_writes(project):
    root, out, left_behind = project
    plain, steps = parse_console(out)
    one_plain, one_steps = parse_console(single(root, "one"))
    assert steps == one_steps and len(steps) >= STEPS - 1  # the dashboard's view: as one process, printed once
    assert out.count(P.TRAINING_DONE) == 1 and out.count("Saved checkpoint") == 2
    assert [re.sub(r"\bone\b", "dp", line) for line in one_plain[1:]] == plain[2:]  # after the launch line
    _, two_ranks = state_at(root, "dp", STEPS)
    _, one_rank = state_at(root, "one", STEPS)
    assert two_ranks.loop["world_size"] == 2 and two_ranks.sampler == one_rank.sampler
    written = sorted(p.relative_to(root / "runs" / "dp").parts[-1] for p in (root / "runs" / "dp").rglob("*"))
    assert (
        len([w for w in written if w.endswith(".safetensors")]) == 2
        and len(list((root / "runs" / "dp").iterdir())) == 3
    )
    assert not left_behind  # rank 1's scratch folder (in the system temp folder) is gone


def seed_runs(prefix, seed, **extra):
    return dp_params(f"{prefix}{seed}", seed=seed, checkpoint_every=STEPS, **extra)


@pytest.fixture(scope="module")
def seeds(project):
    """The 2-rank runs of SEEDS (one launch: "dp" is the first), the 1-rank runs with grad_accum 2 and
    the plain 1-rank runs (a state after every step: the first step's gradients), by seed."""
    root = project[0]
    code, _, err = run_launch(root, [seed_runs("dp", seed) for seed in SEEDS[1:]])
    assert code == 0, err
    for seed in SEEDS:
        single(root, f"accum{seed}", seed=seed, checkpoint_every=STEPS, grad_accum=2)
        single(root, f"plain{seed}", seed=seed, checkpoint_every=1)
    two_ranks = {seed: state_at(root, "dp" if seed == SEEDS[0] else f"dp{seed}", STEPS)[1] for seed in SEEDS}
    return {
        seed: (two_ranks[seed], state_at(root, f"accum{seed}", STEPS)[1], state_at(root, f"plain{seed}", STEPS)[1])
        for seed in SEEDS
    }


def test_two_ranks_compute_bit_for_bit_what_one_rank_with_grad_accum_2_does(seeds):
    # the same micro-batches (the same rows, draws and shapes): 2 ranks of one micro-batch each sum their
    # gradients in the ring's all_sum, a + b on both ranks, where 1 rank adds its two, then both divide by 2
    for seed, (two_ranks, accum, _) in seeds.items():
        assert two_ranks.sampler == accum.sampler and two_ranks.step == accum.step == STEPS
        assert identical(two_ranks, accum), seed  # every adapter tensor and optimizer moment


def test_two_ranks_match_the_plain_one_rank_run_but_for_first_steps_at_adam_eps(project, seeds):
    # The plain run reduces the batch's rows in one graph: only the arithmetic order differs, the difference
    # of any 1-rank rewrite (grad_accum 2, other kernels). Measured (bench/dp_consistency.py, seeds 0-9):
    # >= 105 dB on every tensor for 8 seeds, but 87.7 dB (seed 5, layers.1.cross_attn.to_q lora_B) and
    # 84.7 dB (seed 9, seconds_total embedder lora_B), from one element each whose first gradient was ~0.6
    # eps, where AdamW's first update lr·g/(|g| + eps) turns fp32 rounding into 5-17 % of lr (dp_compare.py).
    # So: >= 90 dB on every tensor without the elements of a first gradient below 10 eps (0-4 of 36864
    # per seed), and those differ by less than one first-step lr.
    root = project[0]
    cfg = TrainJob.from_params(dp_params("any"), "tiny-base", root=root).cfg
    beta1, eps = cfg.betas[0], cfg.eps
    for seed, (two_ranks, _, plain) in seeds.items():
        first = state_at(root, f"plain{seed}", 1)[1]
        noisy = eps_scale_elements(first, beta1, eps)
        assert sum(int(m.sum()) for m in noisy.values()) <= 10, seed
        assert min(psnr_by_tensor(plain, two_ranks, noisy).values()) >= 90.0, seed
        lr1 = float(first.session["optimizer"]["learning_rate"])
        for key, mask in noisy.items():
            assert np.all(np.abs(plain.adapter[key][mask] - two_ranks.adapter[key][mask]) < lr1), (seed, key)


def test_kill_9_of_a_rank_stops_the_run_and_a_rerun_resumes_bit_exactly(project):
    root = project[0]
    params = dp_params("killed")
    p = launch(root, params, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    runs = root / "runs" / "killed"
    deadline = time.monotonic() + 240
    while not any(f"-step={EVERY}-" in c.name for c in list_checkpoints(runs)) if runs.exists() else True:
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    rank1 = subprocess.run(["pgrep", "-f", f"dp_rank.py {root}"], capture_output=True, text=True).stdout.split()
    victim = max(int(pid) for pid in rank1)  # the rank started last: rank 1
    before = scratch_folders()
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30  # bounded: the ring reports the closed socket, mlx.launch ends the rest
    assert p.returncode != 0 and "exited with code -9" in err
    for folder in scratch_folders() - before:  # the killed rank's scratch: nobody was left to remove it
        shutil.rmtree(folder)
    code, out, err = run_launch(root, params)
    assert code == 0, err
    assert f"resume: continuing from killed-step={EVERY}-" in out
    a, straight = state_at(root, "dp", STEPS)
    b, resumed = state_at(root, "killed", STEPS)
    assert all(straight.adapter[k].tobytes() == resumed.adapter[k].tobytes() for k in straight.adapter)
    assert resume_files(a)[0].read_bytes() == resume_files(b)[0].read_bytes()  # optimizer moments too


def test_ctrl_c_stops_every_rank_after_the_same_step_with_a_checkpoint(project):
    root = project[0]
    p = launch(
        root,
        dp_params("interrupted", max_steps=500),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    runs, deadline = root / "runs" / "interrupted", time.monotonic() + 240
    while not (runs.exists() and list_checkpoints(runs)):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: every process of the group
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGINT, err
    [stopped] = re.findall(r"Stopped at step (\d+); a resume continues from (\S+)", out)
    assert stopped[1] == f"interrupted-step={stopped[0]}-epoch={(int(stopped[0]) - 1) // 3}.safetensors"
    assert stopped[1] in [c.name for c in list_checkpoints(runs)]


def test_another_world_size_resumes_and_says_it_is_not_bit_exact(project):
    root = project[0]
    out = single(root, "dp", max_steps=STEPS + 2)  # the 2-rank run continued by one process
    assert "resume: the state was saved by 2 rank(s), this run has 1" in out and "not bit-exact" in out
    # what 2 ranks would have computed: 1 rank with grad_accum 2 (bit for bit, tested above)
    single(root, "accum", grad_accum=2, max_steps=STEPS + 2)
    continued, uninterrupted = state_at(root, "dp", STEPS + 2)[1], state_at(root, "accum", STEPS + 2)[1]
    assert continued.sampler == uninterrupted.sampler and not identical(continued, uninterrupted)
    assert min(psnr_by_tensor(uninterrupted, continued).values()) >= 90.0  # 2 steps of another reduction order


MISMATCH = """
import sys
import mlx.core as mx
from sa3mlx.train import distributed as D
world = D.World.current(D.DistributedSettings(ranks=2, timeout=30))
world.check_same(b"same" * 8, "the start")
try:
    world.check_same(bytes([world.rank]) * 32, "the checkpoint of step 3")
except D.RankMismatch as e:
    print(e, file=sys.stderr)
    sys.exit(D.EXIT_MISMATCH)
"""


def test_ranks_that_disagree_stop_with_a_clear_error(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    err = io.StringIO()
    code = D.relaunch(D.DistributedSettings(ranks=2), [sys.executable, str(script)], err=err)
    assert code == D.EXIT_MISMATCH
    assert (
        err.getvalue().count(
            "ranks disagree at the checkpoint of step 3: the adapter/optimizer/data state of rank(s) [1]"
        )
        == 2
    )


def test_the_run_exit_code_is_the_failing_rank_s_not_the_sigterm_mlx_launch_sends_the_others():
    term = 128 + signal.SIGTERM
    assert D.run_exit_code([(1, D.EXIT_MISMATCH), (0, -signal.SIGTERM)]) == D.EXIT_MISMATCH  # 0: SIGTERMed
    assert D.run_exit_code([(1, D.EXIT_MISMATCH), (0, None)]) == D.EXIT_MISMATCH
    assert D.run_exit_code([(1, -signal.SIGKILL), (0, D.EXIT_PEER_LOST)]) == D.EXIT_PEER_LOST  # rank 0's own first
    assert D.run_exit_code([(1, -signal.SIGKILL), (0, -signal.SIGTERM)]) == 128 + signal.SIGKILL
    assert D.run_exit_code([(0, term), (1, 0)]) == term  # a SIGTERM to the run itself: the first report is a cause
    assert D.run_exit_code([(1, 0), (0, 130)]) == 130 and D.run_exit_code([(0, 0), (1, 0)]) == 0


def test_a_stalled_collective_ends_the_rank_in_bounded_time():
    code = (
        "import time; from sa3mlx.train.distributed import Watchdog; "
        "w = Watchdog(0.5, 'rank 1'); w.arm('step 7'); time.sleep(30)"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == D.EXIT_TIMEOUT and time.monotonic() - started < 10
    assert "rank 1: no progress for 0.5 s in step 7" in result.stderr


def test_settings_launch_and_batch_split(tmp_path):
    assert D.DistributedSettings.from_params(None) == D.DistributedSettings()
    for bad, message in (
        ({"ranks": 0}, "ranks must be"),
        ({"backend": "gloo"}, "backend 'gloo'"),
        ({"timeout": 0}, "timeout must be"),
        ({"rank": 2}, "unknown keys"),
    ):
        with pytest.raises(ValueError, match=message):
            D.DistributedSettings.from_params(bad)
    with pytest.raises(
        ValueError, match="batch_size 6 does not split over 4 ranks x grad_accum 1: use a multiple of 4"
    ):
        D.DistributedSettings(ranks=4).check_batch(6, 1)
    with pytest.raises(ValueError, match="short batch of 2, which does not split over 4 ranks"):
        D.DistributedSettings(ranks=4).check_batch(8, 1, last_batch=2)
    with pytest.raises(ValueError, match=r"train.batch_size 2 does not split over 2 ranks x grad_accum 2"):
        TrainJob.from_params({**TINY_PARAMS, "grad_accum": 2, "distributed": {"ranks": 2}}, "tiny-base", root=tmp_path)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]))
    cmd = D.launch_command(D.DistributedSettings(ranks=2, hostfile=str(hosts)), ["python", "stages/train.py"])
    assert ["--hostfile", str(hosts)] == cmd[cmd.index("--hostfile") : cmd.index("--hostfile") + 2]
    assert cmd[-2:] == ["--", "stages/train.py"] and f"{D.RANKS_ENV}=2" in cmd and "--cwd" in cmd
    with pytest.raises(ValueError, match="lists 2 hosts but train.distributed.ranks is 3"):
        D.launch_command(D.DistributedSettings(ranks=3, hostfile=str(hosts)), ["python", "x.py"])
    local = D.launch_command(D.DistributedSettings(ranks=2), ["python", "x.py"])
    assert local[local.index("-n") + 1] == "2" and "--starting-port" in local


def test_dvc_repro_train_runs_the_stage_on_two_ranks(tmp_path):
    project = make_project(tmp_path / "project")
    text = (project / "params.yaml").read_text()
    max_steps = yaml.safe_load(text)["train"]["max_steps"]
    text = text.replace("    ranks: 1 ", "    ranks: 2 ").replace(f"max_steps: {max_steps} ", "max_steps: 6 ")
    (project / "params.yaml").write_text(text.replace("checkpoint_every: 25 ", "checkpoint_every: 3 "))
    out = run(["dvc", "repro", "train"], project)
    assert "train: 2 ranks via mlx.launch (ring)" in out and out.count(P.TRAINING_DONE) == 1
    name = yaml.safe_load(text)["train"]["name"]
    report = validate(project / "models" / "lora" / f"{name}.safetensors")
    assert report["ok"] and report["config"]["step"] == 6
    assert [step for step, _ in read_history(project / "dvclive" / "train", "train/loss")] == list(range(1, 7))
    assert "didn't change" in run(["dvc", "repro", "train"], project)
