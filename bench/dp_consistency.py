"""Data-parallel consistency of the tiny model, seed by seed (CPU; 2 local ranks, ring back-end).

    python bench/dp_consistency.py [--seeds 0-9] [--steps 10]

Per seed, after `--steps` steps of the tiny test project (tests/test_train_loop_fake.py's params):
- `dp_eq_accum`: the 2-rank run (mlx.launch) against the 1-rank run with grad_accum 2 (the same
  micro-batches): adapters and optimizer moments byte for byte;
- `dp_vs_plain`: the lowest PSNR over the adapter tensors of the 2-rank run against the plain 1-rank
  run of the same global batch, and its tensor; `kernels_vs_plain`: the same for two equivalent plain
  1-rank runs (fast CPU kernels on, SA3MLX_FAST_KERNELS=0 off), the fp32 noise floor;
- the element of the largest 2-rank vs plain difference: its difference in units of the first step's
  lr and its first gradient in units of AdamW's eps (tests/dp_compare.py says why those matter);
- `dp_vs_plain_masked`: the lowest PSNR without the elements whose first gradient was below
  EPS_SCALE·eps, and how many elements that leaves out.
RESULT json last line.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before mlx)

# isort: split
import numpy as np

from sa3mlx.runtime.kernels import SWITCH
from sa3mlx.train.job import TrainJob
from sa3mlx.train.resume import load_resume, resume_files
from sa3mlx.train.runs import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from dp_compare import EPS_SCALE, eps_scale_elements, first_gradients, identical, psnr_by_tensor, worst  # noqa: E402
from dp_rank import run_launch  # noqa: E402
from test_train_loop_fake import TINY_PARAMS, make_tiny_project, reproducible_prompt_encoding  # noqa: E402


def seed_list(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def params(name: str, seed: int, steps: int, **extra) -> dict:
    return {**TINY_PARAMS, "name": name, "seed": seed, "max_steps": steps, "checkpoint_every": steps, **extra}


def state(project: Path, name: str, step: int):
    [checkpoint] = [c for c in list_checkpoints(project / "runs" / name) if f"-step={step}-" in c.name]
    return load_resume(resume_files(checkpoint)[1])


def one_rank(project: Path, p: dict, fast_kernels: bool = True) -> None:
    previous = os.environ.get(SWITCH)
    os.environ[SWITCH] = "1" if fast_kernels else "0"
    try:
        assert (
            TrainJob.from_params({**p, "distributed": {"ranks": 1}}, "tiny-base", root=project).run(io.StringIO()) == 0
        )
    finally:
        os.environ.pop(SWITCH) if previous is None else os.environ.__setitem__(SWITCH, previous)


def lowest(reference, other, leave_out=None) -> list:
    """[lowest PSNR over the adapter tensors (dB, 2 decimals), its tensor]."""
    key, db = worst(psnr_by_tensor(reference, other, leave_out))
    return [round(db, 2), key]


def measure(project: Path, seed: int, steps: int) -> dict:
    cfg = TrainJob.from_params(params("plain", seed, steps), "tiny-base", root=project).cfg
    plain, first = state(project, f"plain{seed}", steps), state(project, f"plain{seed}", 1)
    dp, accum = state(project, f"dp{seed}", steps), state(project, f"accum{seed}", steps)
    db, key = lowest(plain, dp)
    diff = np.abs(plain.adapter[key].astype(np.float64) - dp.adapter[key])
    element = np.unravel_index(int(np.argmax(diff)), diff.shape)
    masks = eps_scale_elements(first, cfg.betas[0], cfg.eps)
    lr1 = float(np.asarray(first.session["optimizer"]["learning_rate"]))  # the lr step 1 used
    return {
        "dp_eq_accum": identical(accum, dp),
        "dp_vs_plain": [db, key],
        "kernels_vs_plain": lowest(plain, state(project, f"kernels{seed}", steps)),
        "worst_element": {
            "index": [int(i) for i in element],
            "diff_over_lr1": float(diff[element] / lr1),
            "first_gradient_over_eps": float(first_gradients(first, cfg.betas[0])[key][element] / cfg.eps),
        },
        "dp_vs_plain_masked": lowest(plain, dp, masks),
        "masked_elements": int(sum(m.sum() for m in masks.values())),
    }


def summary_line(seed: int, r: dict) -> str:
    element = r["worst_element"]
    return (
        f"seed {seed}: 2 ranks == 1 rank grad_accum 2: {r['dp_eq_accum']}; vs plain {r['dp_vs_plain'][0]:.1f} dB "
        f"({r['dp_vs_plain'][1]}), element {tuple(element['index'])} off by {element['diff_over_lr1']:.3f} lr1, "
        f"first |g| {abs(element['first_gradient_over_eps']):.3g} eps; "
        f"kernels on/off {r['kernels_vs_plain'][0]:.1f} dB; "
        f"without {r['masked_elements']} element(s) of |g1| < {EPS_SCALE:g} eps: {r['dp_vs_plain_masked'][0]:.1f} dB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    seeds = seed_list(args.seeds)
    reproducible_prompt_encoding()
    with tempfile.TemporaryDirectory(prefix="sa3mlx-dp-consistency-") as tmp:
        project = make_tiny_project(Path(tmp))
        dp_runs = [params(f"dp{s}", s, args.steps, distributed={"ranks": 2, "timeout": 300}) for s in seeds]
        code, _, err = run_launch(project, dp_runs, timeout=120 + 60 * len(seeds))
        if code:
            print(err, file=sys.stderr)
            return code
        results = {}
        for seed in seeds:
            one_rank(project, params(f"plain{seed}", seed, args.steps, checkpoint_every=1))
            one_rank(project, params(f"kernels{seed}", seed, args.steps), fast_kernels=False)
            one_rank(project, params(f"accum{seed}", seed, args.steps, grad_accum=2))
            results[seed] = measure(project, seed, args.steps)
            print(summary_line(seed, results[seed]), flush=True)
    summary = {
        "seeds": seeds,
        "steps": args.steps,
        "all_dp_eq_accum": all(r["dp_eq_accum"] for r in results.values()),
        "min_dp_vs_plain_db": min(r["dp_vs_plain"][0] for r in results.values()),
        "seeds_below_90_db": [s for s, r in results.items() if r["dp_vs_plain"][0] < 90.0],
        "min_kernels_vs_plain_db": min(r["kernels_vs_plain"][0] for r in results.values()),
        "min_dp_vs_plain_masked_db": min(r["dp_vs_plain_masked"][0] for r in results.values()),
        "per_seed": results,
    }
    print("RESULT " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
