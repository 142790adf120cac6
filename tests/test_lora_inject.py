"""Adapters injected into the tiny converted model: targets, strength 0, trainables, checkpoint round trip."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT
from mlx.utils import tree_flatten
from safetensors.numpy import save_file

from sa3mlx.convert.model import convert_source
from sa3mlx.lora.checkpoint import save_lora
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.inject import (
    apply_checkpoint,
    inject_adapters,
    load_lora_state,
    lora_state,
    model_layers,
    set_strength,
)
from sa3mlx.lora.layers import LoRAShapeError
from sa3mlx.lora.targeting import adaptable_layers, select_layers, summary_line
from sa3mlx.lora.types import ADAPTER_TYPES, SAVED_PARAMS
from sa3mlx.models.conditioning import load_dit
from sa3mlx.models.config import ModelConfig


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-base")
    convert_source(ROOT / "models" / "tiny-base", out)
    return out / "dit.npz"


def _inputs(dit, seed=0):
    cfg = dit.config
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((2, cfg.io_channels, 12)).astype(np.float32))
    t = mx.array(np.array([0.3, 0.8], np.float32))
    context = mx.array(rng.standard_normal((2, 5, cfg.cond_token_dim)).astype(np.float32))
    local = mx.array(rng.standard_normal((2, cfg.local_add_cond_dim, 12)).astype(np.float32))
    return x, t, context, local


def _outputs(dit, cond, seed=0):
    """(velocity, seconds embedding): the DiT fed the conditioner's seconds token as global_cond."""
    x, t, context, local = _inputs(dit, seed)
    seconds = cond.seconds_embedding([3.0, 17.5])
    v = dit(x, t, mx.concatenate([context, seconds], axis=1), seconds[:, 0], local)
    return np.array(v), np.array(seconds)


def _randomize(layers, seed=1):
    """Non-trivial fp16-representable adapter values (B != 0, M_xs != 0, magnitudes moved)."""
    rng = np.random.default_rng(seed)
    state = {}
    for key, value in lora_state(layers).items():
        noise = rng.standard_normal(value.shape).astype(np.float32)
        new = np.array(value) * (1 + 0.2 * noise) if ".magnitude" in key else 0.05 * noise
        state[key] = new.astype(np.float16).astype(np.float32)
    load_lora_state(layers, state)


def test_default_targets_match_the_summary_line(converted, capsys):
    dit, cond = load_dit(converted)
    layers = inject_adapters(dit, cond, LoRAConfig())
    printed = capsys.readouterr().out.strip()
    model = ModelConfig.load(converted.parent / "model_config.json")
    expected = summary_line(
        select_layers(adaptable_layers(model.dit, model.conditioner.cond_dim), LoRAConfig()), LoRAConfig()
    )
    print(printed)
    assert printed == expected
    assert f"{len(layers)} layers" in expected and len(layers) == 7 * model.dit.depth + 1
    assert list(layers)[-1] == "conditioners.seconds_total.embedder.embedding.1"
    assert cond.seconds_linear is layers["conditioners.seconds_total.embedder.embedding.1"]
    assert dit.transformer.layers[0].ff.ff[0].proj is layers["model.transformer.layers.0.ff.ff.0.proj"]


def test_adapt_conditioner_false_leaves_the_seconds_embedder(converted):
    dit, cond = load_dit(converted)
    layers = inject_adapters(dit, cond, LoRAConfig(adapt_conditioner=False), announce=False)
    assert not any(name.startswith("conditioners.") for name in layers)
    assert "seconds_linear" not in cond


@pytest.mark.parametrize("adapter_type", ADAPTER_TYPES)
def test_strength_zero_is_the_base_model_exactly(converted, adapter_type):
    dit, cond = load_dit(converted)
    base = _outputs(dit, cond)
    cfg = LoRAConfig(adapter_type=adapter_type, rank=4, alpha=8, exclude=None)  # every layer, convs too
    for materialize in (True, False):
        dit, cond = load_dit(converted)
        layers = inject_adapters(dit, cond, cfg, key=mx.random.key(3), materialize=materialize, announce=False)
        _randomize(layers)
        adapted = _outputs(dit, cond)
        assert not np.allclose(adapted[0], base[0], atol=1e-4)
        set_strength(layers, 0.0)
        zero = _outputs(dit, cond)
        assert np.array_equal(zero[0], base[0]) and np.array_equal(zero[1], base[1])


def test_only_adapter_tensors_are_trainable(converted):
    dit, cond = load_dit(converted)
    layers = inject_adapters(dit, cond, LoRAConfig(adapter_type="bora", rank=4), announce=False)
    trainable = dict(tree_flatten(dit.trainable_parameters()))
    trainable.update({f"cond.{k}": v for k, v in tree_flatten(cond.trainable_parameters())})
    assert len(trainable) == len(lora_state(layers)) == 4 * len(layers)
    assert all(k.rsplit(".", 1)[-1] in SAVED_PARAMS for k in trainable)
    assert all(v.dtype == mx.float32 for v in trainable.values())
    xs = inject_adapters(*load_dit(converted), LoRAConfig(adapter_type="lora-xs", rank=4), announce=False)
    assert all(set(layer.trainable_parameters()) == {"M_xs"} for layer in xs.values())


def test_save_read_apply_round_trip(converted, tmp_path):
    cfg = LoRAConfig(adapter_type="dora-rows", rank=4)
    dit, cond = load_dit(converted)
    layers = inject_adapters(dit, cond, cfg, key=mx.random.key(5), announce=False)
    _randomize(layers)
    set_strength(layers, 0.5)
    live = _outputs(dit, cond)
    path = save_lora(tmp_path / "run-step=10-epoch=1.safetensors", layers, cfg, step=10, epoch=1)
    dit2, cond2 = load_dit(converted)
    loaded = apply_checkpoint(dit2, cond2, path, strength=0.5, announce=False)
    assert list(loaded) == list(layers)
    replayed = _outputs(dit2, cond2)
    assert np.array_equal(replayed[0], live[0]) and np.array_equal(replayed[1], live[1])
    # resuming: the state goes back into freshly injected adapters
    dit3, cond3 = load_dit(converted)
    again = inject_adapters(dit3, cond3, cfg, key=mx.random.key(9), announce=False)
    load_lora_state(again, lora_state(layers))
    set_strength(again, 0.5)
    assert np.array_equal(_outputs(dit3, cond3)[0], live[0])


def test_apply_checkpoint_exclude_and_mismatch_messages(converted, tmp_path):
    cfg = LoRAConfig(adapter_type="lora", rank=4)
    dit, cond = load_dit(converted)
    layers = inject_adapters(dit, cond, cfg, announce=False)
    path = save_lora(tmp_path / "a.safetensors", layers, cfg, step=1, epoch=0)
    kept = apply_checkpoint(*load_dit(converted), path, exclude=["seconds_total"], announce=False)
    assert len(kept) == len(layers) - 1
    state = {k: np.array(v).astype(np.float16) for k, v in lora_state(layers).items()}
    key = "model.transformer.layers.0.self_attn.to_qkv.parametrizations.weight.0.lora_A"
    state[key] = np.zeros((4, 7), np.float16)
    meta = {"lora_config": json.dumps(cfg.metadata(1, 0))}
    save_file(state, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(LoRAShapeError, match=r"to_qkv: lora_A has shape \(4, 7\).*trained for a different base\?"):
        apply_checkpoint(*load_dit(converted), tmp_path / "bad.safetensors", announce=False)
    state.pop(key)
    state["model.transformer.layers.9.self_attn.to_qkv.parametrizations.weight.0.lora_A"] = np.zeros((4, 7))
    save_file(state, str(tmp_path / "other.safetensors"), metadata=meta)
    with pytest.raises(LoRAShapeError, match=r"layers\.9\.self_attn\.to_qkv.*trained for a different base\?"):
        apply_checkpoint(*load_dit(converted), tmp_path / "other.safetensors", announce=False)
    assert len(model_layers(dit, cond)) == 9 * dit.config.depth + 13
