"""The `svd` stage's base files: contents, precision, deterministic bytes, use by the -xs adapters."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT

from sa3mlx.convert.checkpoint import CheckpointError, read_npz
from sa3mlx.convert.model import convert_source
from sa3mlx.lora.bases import (
    SVD_FILE,
    bases_if_present,
    bases_metadata,
    compute_svd_file,
    read_bases,
    weights_in_precision,
)
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.inject import inject_adapters, model_layers
from sa3mlx.lora.maths import mlx_weight_to_2d
from sa3mlx.lora.svd import svd_bases
from sa3mlx.lora.targeting import npz_weight_key
from sa3mlx.models.conditioning import load_dit


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-base")
    convert_source(ROOT / "models" / "tiny-base", out)
    return out


@pytest.fixture(scope="module")
def svd_dir(converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("svd")
    compute_svd_file(converted, out, max_rank=16)
    return out


def test_every_adaptable_layer_with_top_columns_in_fp32(converted, svd_dir):
    bases = read_bases(svd_dir)
    meta = bases_metadata(svd_dir)
    dit, cond = load_dit(converted / "dit.npz")
    names = [layer.name for layer in model_layers(dit, cond) if min(layer.fan_out, layer.fan_in) >= 2]
    assert set(bases) == set(names)
    assert meta["precision"] == "float16" and meta["max_rank"] == 16 and meta["layers"] == len(names)
    arrays = read_npz(converted / "dit.npz")
    for layer in model_layers(dit, cond):
        parts = bases[layer.name]
        r = min(16, layer.fan_out, layer.fan_in)
        assert parts["U"].shape == (layer.fan_out, r) and parts["V"].shape == (layer.fan_in, r)
        assert parts["S"].shape == (r,) and all(p.dtype == np.float32 for p in parts.values())
    name = "model.preprocess_conv"  # a conv weight: the torch (out, in·k) view
    expected = svd_bases(mlx_weight_to_2d(arrays[npz_weight_key(name)].astype(np.float32)), 16)
    assert all(np.array_equal(expected[k], bases[name][k]) for k in ("U", "V", "S"))


def test_two_runs_give_identical_bytes(converted, svd_dir, tmp_path):
    again = compute_svd_file(converted, tmp_path, max_rank=16)
    assert again.read_bytes() == (svd_dir / SVD_FILE).read_bytes()


def test_precision_rounding():
    w = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    half, name = weights_in_precision(w.astype(np.float16), "stored")
    assert name == "float16" and np.array_equal(half, w.astype(np.float16).astype(np.float32))
    assert np.array_equal(weights_in_precision(w, "float16")[0], half)
    bf16, name = weights_in_precision(w, "bfloat16")
    assert name == "bfloat16"
    assert np.array_equal(bf16, np.array(mx.array(w).astype(mx.bfloat16).astype(mx.float32)))
    with pytest.raises(ValueError, match="svd precision"):
        weights_in_precision(w, "int8")


def test_xs_adapters_built_from_the_file_equal_recomputed_ones(converted, svd_dir):
    cfg = LoRAConfig(adapter_type="bora-xs", rank=4)
    recomputed = inject_adapters(*load_dit(converted / "dit.npz"), cfg, announce=False)
    from_file = inject_adapters(*load_dit(converted / "dit.npz"), cfg, svd_bases=read_bases(svd_dir), announce=False)
    for name, layer in recomputed.items():
        assert np.array_equal(np.array(layer.U), np.array(from_file[name].U))
        assert np.array_equal(np.array(layer.V), np.array(from_file[name].V))


def test_pickle_bases_need_allow_pickle(tmp_path):
    (tmp_path / "bases.pt").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="refusing to read a pickle"):
        read_bases(tmp_path / "bases.pt")
    with pytest.raises(CheckpointError, match="no SVD base file"):
        read_bases(tmp_path)


def test_stage_script_reads_its_params(converted, tmp_path):
    project = tmp_path / "project"
    (project / "models" / "converted").mkdir(parents=True)
    (project / "models" / "converted" / "tiny-base").symlink_to(converted)
    (project / "params.yaml").write_text(
        json.dumps({"model": {"base": "tiny-base"}, "svd": {"max_rank": 8, "precision": "float32"}})
    )
    (project / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())  # the stage reads what it declares
    result = subprocess.run(
        [sys.executable, str(ROOT / "stages" / "svd.py")], cwd=project, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    meta = bases_metadata(project / "models" / "svd" / "tiny-base")
    assert meta["max_rank"] == 8 and meta["precision"] == "float32"


def test_a_base_file_with_too_few_columns_is_refused(converted, svd_dir):
    with pytest.raises(ValueError, match="svd.max_rank >= 32"):
        inject_adapters(
            *load_dit(converted / "dit.npz"),
            LoRAConfig(adapter_type="lora-xs", rank=32),
            svd_bases=read_bases(svd_dir),
            announce=False,
        )


def test_bases_if_present(svd_dir, tmp_path):
    assert bases_if_present(tmp_path) is None
    assert set(bases_if_present(svd_dir)) == set(read_bases(svd_dir))
