"""A throwaway git+dvc copy of this project, for tests that run the real `dvc` command line."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("dvc.yaml", "params.yaml", "stages", "sa3mlx", "models/tiny-base", "models/tiny-arc", "data/raw")


def tool_env() -> dict:
    """The environment with this interpreter's bin first on PATH, so `dvc` and stage `python` are the venv's."""
    return {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}


def run(cmd, cwd, timeout=600):
    """Run a command in `cwd`; fail the test on a non-zero exit; return stdout + stderr."""
    result = subprocess.run(cmd, cwd=cwd, env=tool_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def copy_project(dst: Path, names=PROJECT_FILES) -> Path:
    for name in names:
        src, out = ROOT / name, dst / name
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(src, out)
    return dst


def init_repo(path: Path) -> Path:
    """`git init` + `dvc init` (analytics off) in `path`, with a local git identity so commits work."""
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "tests@sa3mlx.invalid"],
                ["git", "config", "user.name", "sa3mlx tests"], ["dvc", "init", "-q"],
                ["dvc", "config", "core.analytics", "false"]):
        run(cmd, path)
    return path


def make_project(dst: Path, names=PROJECT_FILES) -> Path:
    """Copy the project files into `dst` and make it a git+dvc repo; returns `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    return init_repo(copy_project(dst, names))


def commit_all(path: Path, message: str = "pipeline") -> None:
    run(["git", "add", "-A"], path)
    run(["git", "commit", "-q", "-m", message], path)
