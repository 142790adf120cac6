"""The convert stage under real `dvc` in a throwaway git repo (the whole pipeline's behaviour is in
test_pipeline_behaviour.py)."""

import numpy as np
import pytest
import yaml
from dvc_project import make_project, run


@pytest.fixture
def project(tmp_path):
    return make_project(tmp_path)


def test_changing_a_convert_param_reruns_convert(project):
    run(["dvc", "repro", "convert"], project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["convert"]["dit_dtype"] = "float32"
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    assert "Running stage 'convert'" in run(["dvc", "repro", "convert"], project)
    with np.load(project / "models" / "converted" / "tiny-base" / "dit.npz") as f:
        assert f["transformer.project_in.weight"].dtype == np.float32
