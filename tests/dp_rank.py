"""One rank of a data-parallel test run, started by `relaunch` (mlx.launch):

    python tests/dp_rank.py PROJECT PARAMS_JSON

runs `TrainJob.from_params(PARAMS_JSON, "tiny-base", root=PROJECT).run()` with prompt-cache misses
encoded one prompt per call (as the in-process tests do, so a resume is bit-exact)."""

import json
import sys

import sa3mlx  # noqa: F401  (BLAS set-up before mlx, as in every stage)
from sa3mlx.train.job import TrainJob

if __name__ == "__main__":
    from test_train_loop_fake import reproducible_prompt_encoding

    reproducible_prompt_encoding()
    project, params = sys.argv[1], json.loads(sys.argv[2])
    sys.exit(TrainJob.from_params(params, "tiny-base", root=project).run())
