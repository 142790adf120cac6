"""The DVC pipeline on the embedded default, run with real `dvc` in a throwaway git repo."""

import numpy as np
import pytest
import yaml

from dvc_project import make_project, run


@pytest.fixture
def project(tmp_path):
    return make_project(tmp_path)


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
