"""`stage_params`: a stage sees only the params its dvc.yaml entry declares, and the reads are audited."""

import json
import subprocess
import sys

import pytest
import yaml

from sa3mlx.runtime.errors import ParamError
from sa3mlx.runtime.params import UndeclaredParamError, declared_params, stage_params

DVC = {
    "stages": {
        "fit": {
            "cmd": "python fit.py",
            "params": ["model.base", "fit.lr", "fit.adapter", {"params.yaml": ["fit.seed"]}],
        },
        "whole": {"cmd": "python whole.py", "params": ["fit"]},
        "other": {"cmd": "python other.py", "params": [{"other.yaml": ["x"]}]},
    }
}
PARAMS = {
    "model": {"base": "tiny-base", "arc": "tiny-arc"},
    "fit": {"lr": 1e-4, "batch": 4, "seed": 3, "adapter": {"rank": 16, "include": ["a", "b"]}},
}


@pytest.fixture
def project(tmp_path):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    return tmp_path


def test_only_declared_keys_are_visible(project):
    params = stage_params("fit", project)
    assert sorted(params) == ["fit", "model"]
    assert [k for k in ("base", "arc") if k in params["model"]] == ["base"]
    assert params["fit"]["lr"] == 1e-4 and params["model"]["base"] == "tiny-base"
    assert "batch" not in params["fit"] and "lr" in params["fit"]
    with pytest.raises(UndeclaredParamError, match=r"stage 'fit' reads param 'fit.batch' but dvc.yaml does not"):
        params["fit"]["batch"]
    with pytest.raises(UndeclaredParamError, match="'fit.missing'"):
        params["fit"].get("missing", 1)  # a default must not hide an undeclared read
    with pytest.raises(UndeclaredParamError, match="'svd'"):
        params["svd"]


def test_listing_a_section_with_undeclared_keys_is_refused(project):
    params = stage_params("fit", project)
    with pytest.raises(
        UndeclaredParamError, match=r"params.yaml: fit.batch: unknown key \(stage 'fit' does not declare"
    ):
        dict(params["fit"])
    with pytest.raises(UndeclaredParamError, match=r"params.yaml: model.arc: unknown key"):
        list(params["model"].items())
    assert sorted(params) == ["fit", "model"]  # the root always holds other stages' sections
    assert params["model"]["base"] == "tiny-base"


def test_read_only_and_values_are_copies(project):
    params = stage_params("fit", project)
    with pytest.raises(TypeError):
        params["fit"]["lr"] = 1.0
    adapter = params["fit"]["adapter"]
    adapter["rank"] = 4
    adapter["include"].append("c")
    assert params["fit"]["adapter"] == {"rank": 16, "include": ["a", "b"]}
    assert isinstance(adapter, dict)  # nested values stay plain (presets merge dicts)


def test_reads_are_recorded_at_declared_granularity(project):
    params = stage_params("fit", project)
    usage = params.usage
    assert usage.declared == ["model.base", "fit.lr", "fit.adapter", "fit.seed"]
    params["fit"]["adapter"]
    assert "seed" in params["fit"]  # membership is not a read
    assert usage.read == {"fit.adapter"} and usage.unread() == ["model.base", "fit.lr", "fit.seed"]
    params["fit"]["lr"], params["fit"].get("seed")
    assert usage.unread() == ["model.base"]
    whole = stage_params("whole", project)
    assert whole.to_dict() == {"fit": PARAMS["fit"]}
    assert whole.usage.read == {"fit"} and whole.usage.unread() == []


def test_declared_entries(project):
    assert declared_params("whole", project / "dvc.yaml") == ["fit"]
    with pytest.raises(ValueError, match="only keys of params.yaml"):
        declared_params("other", project / "dvc.yaml")
    with pytest.raises(KeyError, match="no stage 'nope'"):
        stage_params("nope", project)
    (project / "params.yaml").write_text(yaml.safe_dump({"model": {"base": "x"}, "fit": {"lr": 1}}))
    with pytest.raises(ParamError, match="params.yaml: fit.seed: missing"):
        stage_params("fit", project)["fit"]["seed"]
    assert stage_params("fit", project)["fit"].get("seed", 7) == 7  # a declared key may be left to its default


def test_audit_written_at_exit(project, tmp_path):
    audit = tmp_path / "audit"
    script = (
        "from sa3mlx.runtime.params import stage_params\n"
        f"p = stage_params('fit', {str(project)!r})\n"
        "p['fit']['lr']; p['model']['base']\n"
    )
    subprocess.run(
        [sys.executable, "-c", script], check=True, env={"SA3MLX_PARAMS_AUDIT": str(audit), "PATH": "/usr/bin:/bin"}
    )
    record = json.loads((audit / "fit.json").read_text())
    assert record == {
        "stage": "fit",
        "declared": ["fit.adapter", "fit.lr", "fit.seed", "model.base"],
        "read": ["fit.lr", "model.base"],
    }


def test_train_stage_refuses_a_train_key_it_does_not_declare(tmp_path):
    from conftest import ROOT

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"]["grad_accum"] = 2  # a TrainConfig field, set without declaring it in dvc.yaml
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    result = subprocess.run(
        [sys.executable, str(ROOT / "stages" / "train.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "sa3mlx: train: params.yaml: train.grad_accum: unknown key (stage 'train' does not declare it under params: "
        "in dvc.yaml): remove it, or add it there too so a change reruns the stage"
    ]
