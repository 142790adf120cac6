import json
import re
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import save_file

from sa3mlx.convert.checkpoint import CheckpointError
from sa3mlx.lora.checkpoint import apply_lora, checkpoint_file_name, read_lora, run_label, save_lora, session_dir
from sa3mlx.lora.config import DEFAULT_EXCLUDE, LoRAConfig
from sa3mlx.lora.layers import LoRAShapeError, build_adapters
from sa3mlx.lora.targeting import adaptable_layers, select_layers
from sa3mlx.models.config import ModelConfig

ORDER = ["rank", "alpha", "adapter_type", "include", "exclude", "step", "epoch", "base_model"]
OFFICIAL_PARAMS = {"lora_A", "lora_B", "M_xs", "magnitude", "magnitude_r", "magnitude_c"}


def _bases(seed=0):
    rng = np.random.default_rng(seed)
    linear = nn.Linear(24, 40)
    linear.weight = mx.array(rng.standard_normal((40, 24)).astype(np.float32) / 5)
    conv = nn.Conv1d(6, 10, 3, padding=1, bias=False)
    conv.weight = mx.array(rng.standard_normal((10, 3, 6)).astype(np.float32) / 4)
    return {"model.transformer.layers.0.self_attn.to_qkv": linear, "model.preprocess_conv": conv}


def _trained(adapter_type="bora", seed=3, rank=4, alpha=None):
    """Adapters with non-trivial values, reproducible from the seed."""
    layers = build_adapters(_bases(), adapter_type, rank, alpha, seed=seed)
    for layer in layers.values():
        for name, value in layer.lora_state().items():
            layer[name] = value + 0.1 * mx.random.normal(value.shape, key=mx.random.key(seed))
    return layers


def _official_read(path):
    """An independent reader of the official format: header JSON by hand, fp16 tensors, key rule."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    metadata = header.pop("__metadata__")
    tensors = {}
    for key, info in header.items():
        parts = key.split(".")
        assert len(parts) >= 4 and parts[-4] == "parametrizations" and parts[-3] == "weight", key
        assert parts[-2] == "0" and parts[-1] in OFFICIAL_PARAMS, key
        assert info["dtype"] == "F16"
        start, end = info["data_offsets"]
        body = raw[8 + length + start : 8 + length + end]
        tensors[key] = np.frombuffer(body, dtype="<f2").reshape(info["shape"])
    return tensors, metadata


@pytest.mark.parametrize("adapter_type", ["bora", "dora-rows-xs", "lora"])
def test_written_checkpoint_reads_back_identically_under_the_official_rules(tmp_path, adapter_type):
    layers = _trained(adapter_type)
    path = save_lora(
        tmp_path / "run-step=10-epoch=1.safetensors",
        layers,
        LoRAConfig(adapter_type, rank=4),
        step=10,
        epoch=1,
        base_model="sa3-sm-music",
    )
    tensors, metadata = _official_read(path)
    assert list(metadata) == ["lora_config"]
    config = json.loads(metadata["lora_config"])
    assert list(config) == ORDER
    assert metadata["lora_config"] == json.dumps(config)  # json.dumps default separators
    assert config == {
        "rank": 4,
        "alpha": 4,
        "adapter_type": adapter_type,
        "include": None,
        "exclude": list(DEFAULT_EXCLUDE),
        "step": 10,
        "epoch": 1,
        "base_model": "sa3-sm-music",
    }
    expected = {
        f"{name}.parametrizations.weight.0.{param}": np.array(value).astype(np.float16)
        for name, layer in layers.items()
        for param, value in layer.lora_state().items()
    }
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert np.array_equal(tensors[key], value), key
    assert not any(key.endswith((".U", ".V")) for key in tensors)


def test_same_seed_gives_identical_bytes(tmp_path):
    cfg = LoRAConfig("dora-rows", rank=4, alpha=8)
    one = save_lora(tmp_path / "a" / "x.safetensors", _trained("dora-rows"), cfg, 5, 0)
    two = save_lora(tmp_path / "b" / "x.safetensors", _trained("dora-rows"), cfg, 5, 0)
    other = save_lora(tmp_path / "c" / "x.safetensors", _trained("dora-rows", seed=4), cfg, 5, 0)
    assert one.read_bytes() == two.read_bytes() != other.read_bytes()
    assert not list(tmp_path.rglob("*.tmp"))


def test_metadata_rules():
    meta = LoRAConfig(rank=16).metadata(step=1000, epoch=12)
    assert meta["alpha"] == 16 and isinstance(meta["alpha"], int) and "base_model" not in meta
    assert meta["include"] is None
    assert LoRAConfig(rank=16, alpha=32).metadata(1, 0)["alpha"] == 32.0
    assert isinstance(LoRAConfig(rank=16, alpha=32).metadata(1, 0)["alpha"], float)
    assert LoRAConfig(include=("layers.[0-3].",)).metadata(1, 0)["include"] == ["layers.[0-3]."]


def test_file_names_and_session_dirs(tmp_path):
    assert run_label("my-song-20260720143005") == "my-song"
    assert checkpoint_file_name("my-song", 1000, 12) == "my-song-step=1000-epoch=12.safetensors"
    assert checkpoint_file_name(None, 5, 0) == "step=5-epoch=0.safetensors"
    folder = session_dir(tmp_path, "my-song-20260720143005")
    assert re.fullmatch(r"[0-9a-f]{8}", folder.parent.name) and folder.name == "checkpoints"
    assert folder.parent.parent == tmp_path / "my-song-20260720143005"
    assert session_dir(tmp_path, "r", "abcd0123") == tmp_path / "r" / "abcd0123" / "checkpoints"


def test_round_trip_into_fresh_adapters(tmp_path):
    trained = _trained("bora-xs")
    path = save_lora(tmp_path / "x.safetensors", trained, LoRAConfig("bora-xs", rank=4), 3, 1)
    lora = read_lora(path)
    fresh = build_adapters(_bases(), lora.config["adapter_type"], lora.config["rank"], seed=99)
    apply_lora(lora, fresh)
    for name, layer in fresh.items():
        for param, value in layer.lora_state().items():
            stored = np.array(trained[name][param]).astype(np.float16).astype(np.float32)
            assert np.array_equal(np.array(value), stored)


def test_fixture_dit_checkpoint_loads_onto_the_tiny_dit_layers():
    lora = read_lora(FIXTURES / "lora" / "dit_dora_rows.safetensors")
    assert lora.config["base_model"] == "sa3-tiny-fixture" and lora.config["step"] == 1234
    model = ModelConfig.load(FIXTURES / "dit_small" / "model_config.json")
    chosen = select_layers(adaptable_layers(model.dit, model.conditioner.cond_dim), lora.lora_config)
    bases = {layer.name: nn.Linear(layer.fan_in, layer.fan_out) for layer in chosen}
    layers = build_adapters(bases, lora.config["adapter_type"], lora.config["rank"], lora.config["alpha"])
    apply_lora(lora, layers, base_model="sa3-tiny-fixture")
    assert set(lora.layers) == set(layers) and len(layers) == 15
    with pytest.raises(CheckpointError, match="trained for base model 'sa3-tiny-fixture', not 'sa3-medium'"):
        apply_lora(lora, layers, base_model="sa3-medium")


def test_mismatches_name_the_layer(tmp_path):
    path = save_lora(tmp_path / "x.safetensors", _trained("lora"), LoRAConfig("lora", rank=4), 1, 0)
    lora = read_lora(path)
    with pytest.raises(
        LoRAShapeError,
        match=r"model.preprocess_conv: lora_A has shape \(4, 18\).*"
        r"trained for a different base\?",
    ):
        apply_lora(lora, build_adapters(_bases(), "lora", 8))
    other = _bases()
    other["model.preprocess_conv"] = nn.Conv1d(6, 10, 5, bias=False)
    with pytest.raises(LoRAShapeError, match="model.preprocess_conv: lora_A .*different base"):
        apply_lora(lora, build_adapters(other, "lora", 4))
    fewer = build_adapters({"model.preprocess_conv": _bases()["model.preprocess_conv"]}, "lora", 4)
    with pytest.raises(LoRAShapeError, match="'model.transformer.layers.0.self_attn.to_qkv' is not an adapted"):
        apply_lora(lora, fewer)
    with pytest.raises(LoRAShapeError, match="is dora-rows here but lora in the file"):
        apply_lora(lora, build_adapters(_bases(), "dora-rows", 4))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin"])
def test_pickles_are_refused(tmp_path, suffix):
    path = tmp_path / f"adapter{suffix}"
    path.write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="pickles .* not loaded"):
        read_lora(path)


def test_missing_fields_are_back_filled_and_legacy_dora_resolved(tmp_path):
    path = tmp_path / "old.safetensors"
    key = "model.transformer.layers.0.ff.ff.2.parametrizations.weight.0."
    save_file(
        {
            key + "lora_A": np.zeros((2, 8), np.float16),
            key + "lora_B": np.zeros((4, 2), np.float16),
            key + "magnitude": np.ones((1, 8), np.float16),
        },
        path,
        metadata={"lora_config": json.dumps({"rank": 2, "adapter_type": "dora"})},
    )
    lora = read_lora(path)
    assert lora.config["alpha"] == 2 and lora.config["include"] is None and lora.config["exclude"] is None
    assert lora.stored_adapter_type == "dora" and lora.config["adapter_type"] == "dora-cols"
    assert lora.layers["model.transformer.layers.0.ff.ff.2"]["magnitude"].shape == (8,)
    legacy = read_lora(FIXTURES / "lora" / "layer_dora_legacy_cols.safetensors")
    assert legacy.config["adapter_type"] == "dora-cols"
    assert read_lora(FIXTURES / "lora" / "layer_dora.safetensors").config["adapter_type"] == "dora-rows"
