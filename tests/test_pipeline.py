"""The DVC pipeline on the embedded default, run with real `dvc` in a throwaway git repo."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from conftest import ROOT

PROJECT_FILES = ("dvc.yaml", "params.yaml", "stages", "sa3mlx", "models/tiny-base", "models/tiny-arc", "data/raw")


def run(cmd, cwd):
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


@pytest.fixture
def project(tmp_path):
    for name in PROJECT_FILES:
        src, dst = ROOT / name, tmp_path / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(src, dst)
    run(["git", "init", "-q"], tmp_path)
    run(["dvc", "init", "-q"], tmp_path)
    run(["dvc", "config", "core.analytics", "false"], tmp_path)
    return tmp_path


def test_repro_converts_then_does_nothing(project):
    first = run(["dvc", "repro"], project)
    assert "Running stage 'convert'" in first
    for name in ("tiny-base", "tiny-arc"):
        with np.load(project / "models" / "converted" / name / "dit.npz") as f:
            assert len(f.files) == 63
    second = run(["dvc", "repro"], project)
    assert "Running stage" not in second
    assert "up to date" in run(["dvc", "status"], project)


def test_changing_a_convert_param_reruns_convert(project):
    run(["dvc", "repro", "convert"], project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["convert"]["dit_dtype"] = "float32"
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    assert "Running stage 'convert'" in run(["dvc", "repro", "convert"], project)
    with np.load(project / "models" / "converted" / "tiny-base" / "dit.npz") as f:
        assert f["transformer.project_in.weight"].dtype == np.float32
