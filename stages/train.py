"""DVC stage `train`: data/latents + models/converted/<base> -> models/lora/<name>.safetensors.

    python stages/train.py [--smoke]

Checkpoints and resume states go to runs/<name>/ (kept across runs: a rerun resumes when only
max_steps / max_minutes changed, and starts over otherwise), curves to dvclive/train/.
`touch runs/<name>/SAVE_NOW` or SIGUSR1 saves after the current step; Ctrl-C saves and exits.
With `train.demos.every` > 0, demos are rendered into runs/<name>/demos/ as training goes.
With `train.distributed.ranks` > 1 the script starts itself on every rank through `mlx.launch`
(docs/distributed.md); rank 0 writes the outputs. The smoke test runs in one process.
"""

import argparse
import sys

import sa3mlx  # noqa: F401  (BLAS set-up first, as in every stage)
from sa3mlx.runtime.errors import run_stage
from sa3mlx.runtime.params import stage_params
from sa3mlx.train.distributed import launched, relaunch
from sa3mlx.train.job import TrainJob


def main() -> int:
    sys.stdout.reconfigure(errors="backslashreplace", line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="run the resume smoke test (as train.smoke: true)")
    args = parser.parse_args()
    params = stage_params("train")
    job = TrainJob.from_params(params["train"], base=params["model"]["base"], arc=params["model"]["arc"])
    if args.smoke or job.smoke_mode:
        return job.smoke()
    if job.distributed.ranks > 1 and not launched():
        return relaunch(job.distributed, [sys.executable, *sys.argv])
    return job.run()


if __name__ == "__main__":
    run_stage("train", main)
