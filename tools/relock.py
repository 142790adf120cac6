"""Regenerate the committed dvc.lock (and the dvclive metrics it records) from a clean checkout.

    python tools/relock.py

Copies the tracked project files (no `__pycache__`, no local outputs) into a temporary git+dvc repo,
runs `dvc repro` there as a user's shell would (bytecode on), and copies `dvc.lock` and `dvclive/`
back, so a fresh clone's `dvc status` agrees with the committed lock.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from dvc_project import make_project  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="sa3mlx-relock-") as tmp:
        project = make_project(Path(tmp) / "project")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        env["PYTHONPATH"] = str(project)
        subprocess.run(["dvc", "repro"], cwd=project, env=env, check=True)
        shutil.copyfile(project / "dvc.lock", ROOT / "dvc.lock")
        shutil.rmtree(ROOT / "dvclive", ignore_errors=True)
        shutil.copytree(project / "dvclive", ROOT / "dvclive")
    print("relock: dvc.lock and dvclive/ written from a clean checkout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
