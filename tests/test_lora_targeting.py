import json

import pytest
from conftest import FIXTURES

from sa3mlx.lora.config import DEFAULT_EXCLUDE, LoRAConfig
from sa3mlx.lora.targeting import (
    adaptable_layers,
    checkpoint_name,
    count_adapter,
    expand,
    is_selected,
    matches_any,
    mlx_module_path,
    select_layers,
    summary_line,
)
from sa3mlx.models.config import DiTConfig

SMALL_MUSIC = DiTConfig(
    io_channels=256,
    embed_dim=1024,
    depth=20,
    num_heads=16,
    cond_token_dim=768,
    global_cond_dim=768,
    local_add_cond_dim=257,
    num_memory_tokens=64,
    timestep_features_dim=256,
    ff_inner=4096,
    differential=False,
)
SECONDS = "conditioners.seconds_total.embedder.embedding.1"


def test_small_music_default_target_summary():
    layers = select_layers(adaptable_layers(SMALL_MUSIC, 768), LoRAConfig())
    line = summary_line(layers, LoRAConfig())
    print(line)
    assert count_adapter(layers, LoRAConfig()) == (141, 423, 9_212_672)
    assert line.endswith("141 layers, 423 keys, 9,212,672 parameters")
    assert layers[-1].name == SECONDS and (layers[-1].fan_out, layers[-1].fan_in) == (768, 256)
    per_block = [layer.name for layer in layers if layer.name.startswith("model.transformer.layers.3.")]
    assert [n.split("layers.3.")[1] for n in per_block] == [
        "self_attn.to_qkv",
        "self_attn.to_out",
        "cross_attn.to_q",
        "cross_attn.to_kv",
        "cross_attn.to_out",
        "ff.ff.0.proj",
        "ff.ff.2",
    ]


def test_adapt_conditioner_false_drops_the_seconds_embedder():
    cfg = LoRAConfig(adapt_conditioner=False)
    layers = select_layers(adaptable_layers(SMALL_MUSIC, 768), cfg)
    assert len(layers) == 140 and all(layer.name != SECONDS for layer in layers)
    assert cfg.exclude_patterns() == [*DEFAULT_EXCLUDE, "seconds_total"]


def test_every_adaptable_layer_and_the_conv_fan_in():
    layers = {layer.name: layer for layer in adaptable_layers(SMALL_MUSIC, 768)}
    assert len(layers) == 9 + 9 * 20 + 3 + 1
    conv = layers["model.preprocess_conv"]
    assert conv.is_conv and (conv.fan_out, conv.fan_in, conv.kernel) == (256, 256, 1)


def test_expand_and_substring_matching_follow_the_official_rules():
    examples = json.loads((FIXTURES / "lora" / "include_exclude_examples.json").read_text())
    for pattern, expansion in examples["expand"].items():
        assert expand(pattern) == expansion
    assert expand("a[1-2]b[3-2]") == ["a1b3", "a1b2", "a2b3", "a2b2"]
    assert matches_any("model.transformer.layers.10.ff.ff.2", ["layers.1"])
    assert not matches_any("model.transformer.layers.10.ff.ff.2", ["layers.1."])
    assert matches_any("model.transformer.layers.0.self_attn.to_qkv", [" self_attn "])
    assert not matches_any("anything", None) and not matches_any("anything", [])


@pytest.mark.parametrize("include", [None, [], ()])
def test_absent_or_empty_include_is_no_filter(include):
    assert is_selected("model.transformer.layers.0.ff.ff.2", include, None)
    assert LoRAConfig(include=include).include_patterns() is None


def test_exclude_wins_over_include():
    assert not is_selected("model.transformer.layers.1.ff.ff.2", ["layers.1."], ["ff.ff.2"])
    assert is_selected("model.transformer.layers.1.ff.ff.0.proj", ["layers.1."], ["ff.ff.2"])
    assert not is_selected("model.transformer.layers.2.ff.ff.2", ["layers.1."], None)


def test_tiny_dit_adapted_layers_match_the_official_list():
    from sa3mlx.models.config import ModelConfig

    expected = json.loads((FIXTURES / "lora" / "dit_lora_layers.json").read_text())
    model = ModelConfig.load(FIXTURES / "dit_small" / "model_config.json")
    meta = expected["lora_config_metadata"]
    cfg = LoRAConfig(
        adapter_type=meta["adapter_type"], rank=meta["rank"], alpha=meta["alpha"], exclude=tuple(meta["exclude"])
    )
    chosen = select_layers(adaptable_layers(model.dit, model.conditioner.cond_dim), cfg)
    assert [layer.name for layer in chosen] == expected["adapted_layers"]


def test_checkpoint_names_map_to_mlx_module_paths():
    name = "model.transformer.layers.3.to_local_embed.2"
    assert mlx_module_path(name) == "transformer.layers.3.to_local_embed.seq.2"
    assert checkpoint_name("transformer.layers.3.to_local_embed.seq.2") == name
    assert mlx_module_path("model.transformer.layers.0.ff.ff.0.proj") == "transformer.layers.0.ff.ff.0.proj"
    assert mlx_module_path(SECONDS) is None
    for layer in adaptable_layers(SMALL_MUSIC, 768)[:-1]:
        assert checkpoint_name(mlx_module_path(layer.name)) == layer.name


def test_small_music_summary_on_a_random_weight_model(capsys):
    """Inject the default adapters into a real-size random-weight small-music DiT and count them."""
    import mlx.core as mx

    from sa3mlx.lora.inject import inject_adapters
    from sa3mlx.models.conditioning import Conditioner
    from sa3mlx.models.dit import DiT

    mx.random.seed(0)
    dit, cond = DiT(SMALL_MUSIC), Conditioner(768)
    layers = inject_adapters(dit, cond, LoRAConfig())
    trainable = sum(v.size for _, v in _leaves(dit.trainable_parameters()) + _leaves(cond.trainable_parameters()))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    print(line)
    assert line.endswith("141 layers, 423 keys, 9,212,672 parameters")
    assert len(layers) == 141 and trainable == 9_212_672


def _leaves(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
