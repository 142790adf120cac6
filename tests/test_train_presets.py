"""Preset table: the three conventions, overrides, clear errors, fingerprint fields."""

import json
from dataclasses import fields, replace

import pytest

from sa3mlx.data.prompts import PromptTemplate
from sa3mlx.lora.config import DEFAULT_EXCLUDE, LoRAConfig
from sa3mlx.train import presets as P


def test_dashboard_is_the_default():
    cfg = P.resolve()
    assert cfg == P.resolve("underfit-dashboard")
    assert cfg.adapter == LoRAConfig() and cfg.adapter.adapter_type == "dora-rows" and cfg.adapter.rank == 16
    assert cfg.timestep_sampler == "trunc_logit_normal"
    assert (cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay) == (1e-4, (0.9, 0.95), 1e-8, 0.01)
    assert cfg.lr_schedule == "inverse" and cfg.lr_schedule_options["warmup"] == 0.995
    assert cfg.grad_clip == 1.0 and cfg.inpaint_mask_probabilities == (0.2, 0.6, 0.2)
    assert cfg.cfg_dropout_prob == 0.1 and cfg.seed == 42 and cfg.checkpoint_every == 1000


def test_loop_preset_needs_an_lr_and_has_torch_defaults():
    with pytest.raises(ValueError, match="lr is required"):
        P.resolve("underfit-loop")
    cfg = P.resolve("underfit-loop", {"lr": 3e-4})
    assert cfg.timestep_sampler == "uniform" and cfg.betas == (0.9, 0.999) and cfg.weight_decay == 0.01
    assert cfg.lr_schedule == "none" and cfg.grad_clip is None and cfg.inpaint_mask_probabilities is None
    assert cfg.batch_size == 1 and cfg.mask_padding_attention is None


def test_official_preset():
    cfg = P.resolve("sa3-official")
    assert cfg.adapter.exclude is None and cfg.adapter.exclude_patterns() is None
    assert cfg.mask_padding_attention is None and cfg.mask_loss_weight == 1.0
    assert cfg.inpaint_mask_probabilities == (0.1, 0.8, 0.1) and cfg.lr_schedule == "none"
    assert cfg.grad_clip is None and cfg.latent_crop_length == 4091 and cfg.use_effective_length_for_schedule


def test_every_field_is_overridable_and_nested_configs_merge():
    cfg = P.resolve(
        "sa3-official",
        {
            "adapter": {"rank": 8, "exclude": ["seconds_total"]},
            "batch_size": 2,
            "prompts": {"trigger": "zxq", "trigger_pct": 50},
            "betas": [0.8, 0.9],
            "inpaint_mask_probabilities": [0, 1, 0],
        },
    )
    assert cfg.adapter == LoRAConfig(rank=8, exclude=("seconds_total",))
    assert cfg.prompts == PromptTemplate(trigger="zxq", trigger_probability=0.5)
    assert cfg.betas == (0.8, 0.9) and cfg.batch_size == 2 and cfg.inpaint_mask_probabilities == (0.0, 1.0, 0.0)
    for f in fields(P.TrainConfig):  # every field is accepted as an override, one at a time
        assert getattr(P.resolve(None, {f.name: getattr(cfg, f.name)}), f.name) == getattr(cfg, f.name)
    assert P.resolve(None, {**cfg.as_dict(), "prompts": None}) == replace(cfg, prompts=None)
    assert P.resolve(None, {"adapter": {"rank": 4}}).adapter.exclude == DEFAULT_EXCLUDE


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"learning_rate": 1e-4}, "unknown train setting"),
        ({"timestep_sampler": "cosine"}, "unknown timestep sampler"),
        ({"lr_schedule": "cosine"}, "unknown lr_schedule"),
        ({"lr_schedule": "wsd", "lr_schedule_options": {}}, "needs max_minutes"),
        ({"lr_schedule_options": {"gamma": 2}}, "bad options"),
        ({"loss_normalization": "batch"}, "loss_normalization"),
        ({"inpaint_mask_probabilities": [0.5, 0.5]}, "inpaint_mask_probabilities"),
        ({"batch_size": 0}, "batch_size"),
        ({"adapter": {"rank": 0}}, "rank"),
        ({"prompts": {"triger": "x"}}, "unknown prompt template"),
    ],
)
def test_bad_settings_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        P.resolve(None, overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown train preset"):
        P.resolve("underfit")


def test_crop_length_and_fingerprint():
    cfg = P.resolve()
    assert cfg.crop_length("small-music-base") == 1300 and cfg.crop_length("medium-base") == 4096
    with pytest.raises(ValueError, match="latent_crop_length"):
        cfg.crop_length("tiny-base")
    assert P.resolve(None, {"latent_crop_length": 64}).crop_length("tiny-base") == 64
    fp = cfg.fingerprint_dict()
    json.dumps(fp)
    assert "max_steps" not in fp and "max_minutes" not in fp and fp["adapter"]["rank"] == 16
    assert fp == P.resolve(None, {"max_steps": 5, "max_minutes": 3}).fingerprint_dict()
    assert fp != P.resolve(None, {"lr": 2e-4}).fingerprint_dict()
    wsd = P.resolve(None, {"lr_schedule": "wsd", "lr_schedule_options": {}, "max_minutes": 30})
    assert wsd.fingerprint_dict()["max_minutes"] == 30


@pytest.mark.parametrize("preset", sorted(P.PRESETS))
def test_every_preset_takes_padding_attention_from_the_model(preset):
    from conftest import ROOT

    from sa3mlx.models.config import ModelConfig

    model = ModelConfig.load(ROOT / "models" / "tiny-base" / "model_config.json")
    assert model.mask_padding_attention  # the shipped SA3 configs and tiny-base say true
    for says in (True, False):
        given = replace(model, mask_padding_attention=says)
        cfg = P.resolve(preset, {"lr": 1e-4}).for_model(given)
        assert cfg.mask_padding_attention is says
        overridden = P.resolve(preset, {"lr": 1e-4, "mask_padding_attention": not says}).for_model(given)
        assert overridden.mask_padding_attention is (not says)
    resolved = P.resolve(preset, {"lr": 1e-4}).for_model(model)
    assert resolved.use_effective_length_for_schedule in (True, False)
    assert resolved.for_model(model) == resolved
