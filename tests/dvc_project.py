"""A throwaway git+dvc copy of this project, for tests that run the real `dvc` command line."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILES = (
    ".dvcignore",
    ".gitignore",
    "dvc.yaml",
    "params.yaml",
    "stages",
    "sa3mlx",
    "models/tiny-base",
    "models/tiny-arc",
    "data/raw",
)


def tool_env(extra: dict | None = None) -> dict:
    """The environment with this interpreter's bin first on PATH, so `dvc` and stage `python` are the venv's
    (an `extra` value of None removes that variable)."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}", **(extra or {})}
    return {key: value for key, value in env.items() if value is not None}


def run(cmd, cwd, timeout=600, env: dict | None = None):
    """Run a command in `cwd` (`env`: extra variables); fail the test on a non-zero exit; return stdout + stderr."""
    result = subprocess.run(cmd, cwd=cwd, env=tool_env(env), capture_output=True, text=True, timeout=timeout)
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
    for cmd in (
        ["git", "init", "-q"],
        ["git", "config", "user.email", "tests@sa3mlx.invalid"],
        ["git", "config", "user.name", "sa3mlx tests"],
        ["dvc", "init", "-q"],
        ["dvc", "config", "core.analytics", "false"],
    ):
        run(cmd, path)
    return path


def make_project(dst: Path, names=PROJECT_FILES) -> Path:
    """Copy the project files into `dst` and make it a git+dvc repo; returns `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    return init_repo(copy_project(dst, names))


def commit_all(path: Path, message: str = "pipeline") -> None:
    run(["git", "add", "-A"], path)
    run(["git", "commit", "-q", "-m", message], path)


def ran_stages(output: str) -> list[str]:
    """The stages whose command `dvc repro` / `dvc exp run` executed, in order."""
    return re.findall(r"Running stage '([^']+)'", output)


def restored_stages(output: str) -> list[str]:
    """The stages DVC restored from its run-cache instead of running."""
    return re.findall(r"Stage '([^']+)' is cached - skipping run", output)


def fork(project: Path, dst: Path) -> Path:
    """A copy of a (reproduced) project, its git repo and DVC cache included, for a test that changes it."""
    shutil.copytree(project, dst, symlinks=True)
    return dst
