"""One rank of a data-parallel test run, started by `relaunch` (mlx.launch):

    python tests/dp_rank.py PROJECT PARAMS_JSON

runs `TrainJob.from_params(PARAMS_JSON, "tiny-base", root=PROJECT).run()` (PARAMS_JSON: one params
object, or a list of them run one after the other in the same ranks) with prompt-cache misses
encoded one prompt per call (as the in-process tests do, so a resume is bit-exact). `launch` and
`run_launch` start it on 2 local ranks from a test or bench script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before mlx, as in every stage)
from sa3mlx.train.job import TrainJob

HERE = Path(__file__).resolve().parent


def launch(project, params, **popen) -> subprocess.Popen:
    """The 2-rank run of `params` (one object or a list) through `relaunch` (mlx.launch), as a child process."""
    code = (
        "import sys, json; from sa3mlx.train.distributed import DistributedSettings, relaunch; "
        f"sys.exit(relaunch(DistributedSettings(ranks=2), [sys.executable, {str(HERE / 'dp_rank.py')!r}, "
        f"{str(project)!r}, {json.dumps(params)!r}]))"
    )
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=HERE.parent, env=env, text=True, **popen)


def run_launch(project, params, timeout: float = 300) -> tuple[int, str, str]:
    p = launch(project, params, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def main(project: str, params_json: str) -> int:
    from test_train_loop_fake import reproducible_prompt_encoding

    reproducible_prompt_encoding()
    params = json.loads(params_json)
    for one in params if isinstance(params, list) else [params]:
        code = TrainJob.from_params(one, "tiny-base", root=project).run()
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
