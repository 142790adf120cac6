"""Parity kind `train_step`: one rectified-flow LoRA training step of `train_step/` — the loss,
the prediction and every adapter gradient for its three scenarios, and the shared intermediates.

The scenarios are the groups of `expected.npz` (A official step with inpainting masks, B
underfit's ones-mask loop, C official train_lora flags); each one's gradients go to
`grads_<scenario>.npz`. The model is the fixture's DiT with the adapters of its adapter file,
injected with `sa3mlx.lora.inject` in the form training uses; timesteps, noise and masks are the
stored draws.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from sa3mlx.convert.checkpoint import read_safetensors
from sa3mlx.convert.dit import dit_to_mlx, split_sa3_state
from sa3mlx.lora.checkpoint import apply_lora, read_lora
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.inject import inject_adapters, set_strength
from sa3mlx.models.conditioning import Conditioner, build_dit
from sa3mlx.models.config import ModelConfig
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import ParityError, register
from sa3mlx.parity.t5gemma import encode_fixture_ids
from sa3mlx.sample.shifts import make_shift
from sa3mlx.train.objective import ObjectiveConfig, loss_masks
from sa3mlx.train.step import TRAIN_MATERIALIZE, AdapterParams, loss_and_grads
from sa3mlx.train.timesteps import effective_seq_len, shift_timesteps

EXPECTED, INTERMEDIATES = "expected.npz", "intermediates.npz"
# official switches this runner reproduces only in their "off" state
OFF_SWITCHES = {"ot_coupling": False, "silence_extension_scale_seconds": 0.0, "p_one_shot": 0.0}


def load_model(fixture: Fixture, params: dict):
    """(dit, cond, adapted layers) with the fixture's base weights (fp32) and adapter file."""
    refs = fixture.inputs(EXPECTED)
    config = ModelConfig.load(fixture.path(refs["config"]))
    state, _ = read_safetensors(fixture.path(refs["base_model"]))
    dit_state, cond_state, _ = split_sa3_state(state)
    dtype = {"float32": mx.float32}.get(params["model_dtype"])
    if dtype is None:
        raise ParityError(f"{fixture.dir}: unsupported model_dtype {params['model_dtype']}")
    dit, cond = build_dit(
        dit_to_mlx(dit_state, cond_state), config.dit, Conditioner.from_config(config.conditioner), dtype
    )
    lora_cfg = LoRAConfig(
        adapter_type=params["adapter_type"],
        rank=params["rank"],
        alpha=params["alpha"],
        include=tuple(params["include"]) if params["include"] else None,
        exclude=tuple(params["exclude"]) if params["exclude"] is not None else None,
        adapt_conditioner="model.conditioner" in params["adapter_targets"],
    )
    layers = inject_adapters(dit, cond, lora_cfg, materialize=TRAIN_MATERIALIZE, announce=False)
    lora = read_lora(fixture.path(refs["adapters"]))
    missing = sorted(set(layers) - set(lora.layers))
    if missing:
        raise ParityError(f"{fixture.dir}: adapter file lacks layers {missing[:3]}")
    apply_lora(lora, layers)
    set_strength(layers, params["lora_strength"])
    return dit, cond, layers


def shared_inputs(fixture: Fixture, params: dict) -> dict:
    """Host arrays common to every scenario: draws, shifted t, lengths, prompt hidden states."""
    refs = fixture.inputs(EXPECTED)
    if params["diffusion_objective"] != "rectified_flow":
        raise ParityError(f"{fixture.dir}: objective {params['diffusion_objective']} is not reproduced")
    for name, off in OFF_SWITCHES.items():
        if params.get(name, off) != off:
            raise ParityError(f"{fixture.dir}: {name} = {params[name]} is not reproduced (only {off})")
    x0 = fixture.load(refs["x0"]).astype(np.float32) / np.float32(params["pretransform_scale"])
    seconds = fixture.load(refs["seconds_total"])
    if params["use_effective_length_for_schedule"]:
        lengths = effective_seq_len(seconds, params["sample_rate"], params["downsampling_ratio"])
        seq_len = lengths
    else:
        lengths, seq_len = None, int(x0.shape[-1])
    t = shift_timesteps(fixture.load(params["t_raw"]), make_shift(params["dist_shift"]), seq_len)
    ids, mask = fixture.load(refs["prompt_input_ids"]), fixture.load(refs["prompt_attention_mask"])
    hidden = encode_fixture_ids(fixture.path(refs["t5gemma"]), ids, mask, params["model_dtype"])
    drop = np.zeros(x0.shape[0], bool) if params["cfg_dropout_prob"] == 0 else None
    if drop is None:
        raise ParityError(f"{fixture.dir}: cfg dropout needs its draws; only cfg_dropout_prob 0 is reproduced")
    return {
        "x0": x0,
        "noise": fixture.load(params["noise"]),
        "t": t,
        "seconds": seconds.astype(np.float32),
        "prompt_hidden": hidden,
        "prompt_mask": mask.astype(bool),
        "drop": drop,
        "padding_mask": fixture.load(refs["padding_mask"]).astype(bool),
        "lengths": lengths,
    }


def scenario_objective(params: dict) -> ObjectiveConfig:
    """The objective of one scenario's params (official flags, or B's compute_masked_loss args)."""
    if params.get("attention_padding_handling", "v_zeroing") != "v_zeroing":
        raise ParityError(f"attention padding handling {params['attention_padding_handling']} is not reproduced")
    attention_mask = bool(params.get("mask_padding_attention", False))
    signal_only = bool(params.get("loss_mask_padding_attention", attention_mask))
    weight = float(params.get("loss_mask_loss_weight", params.get("mask_loss_weight", 0.0)))
    return ObjectiveConfig(
        cfg_dropout_prob=params["cfg_dropout_prob"],
        dit_padding_mask=params.get("dit_padding_mask") is not None,
        loss_on_signal_only=signal_only,
        padding_loss_weight=0.0 if signal_only else weight,
        context_loss_weight=float(params.get("mask_loss_weight", 0.0)) if params.get("context_loss_term") else 0.0,
        loss_normalization=params["loss_normalization"],
        count_eps=params["loss_count_eps"],
    )


def run_scenario(fixture: Fixture, group: str, model, shared: dict):
    """(loss, per-sample loss, v, grads by checkpoint key) of one expected.npz group."""
    dit, cond, layers = model
    params, refs = fixture.params(EXPECTED, group), fixture.inputs(EXPECTED, group)
    batch = {k: mx.array(v) for k, v in shared.items() if k != "lengths"}
    if params.get("inpainting"):
        batch["inpaint_mask"] = mx.array(fixture.load(refs["inpaint_mask"]))
    adapter_params = AdapterParams(layers)
    (loss, per_sample, v), grads = loss_and_grads(dit, cond, adapter_params, scenario_objective(params))(
        adapter_params.read(), batch
    )
    mx.eval(loss, per_sample, v, grads)
    return loss, per_sample, v, grads


def intermediates(fixture: Fixture, cond: Conditioner, shared: dict) -> dict[str, np.ndarray]:
    x0, noise, t = shared["x0"], shared["noise"], shared["t"]
    padding = mx.array(shared["padding_mask"])
    out = {
        "t": t,
        "noised": (x0 * (1 - t[:, None, None]) + noise * t[:, None, None]).astype(np.float32),
        "target": (noise - x0).astype(np.float32),
        "prompt_embedding": np.array(
            cond.apply_padding(mx.array(shared["prompt_hidden"]), mx.array(shared["prompt_mask"]))
        ),
        "seconds_embedding": np.array(cond.seconds_embedding(shared["seconds"])),
    }
    if shared["lengths"] is not None:
        out["effective_seq_len"] = shared["lengths"].astype(np.int64)
    for group in fixture.groups(INTERMEDIATES):
        ref = fixture.inputs(INTERMEDIATES, group).get("inpaint_mask")
        if ref is None:
            continue
        loss_mask, context_mask = loss_masks(padding, mx.array(fixture.load(ref)))
        scenario = group.split("_")[0]
        out[f"{scenario}_loss_mask"] = np.array(loss_mask)
        out[f"{scenario}_context_mask"] = np.array(context_mask)
    return out


@register("train_step")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    params = fixture.params(EXPECTED)
    model = load_model(fixture, params)
    shared = shared_inputs(fixture, params)
    outputs = {EXPECTED: {}}
    for group in fixture.groups(EXPECTED):
        loss, per_sample, v, grads = run_scenario(fixture, group, model, shared)
        outputs[EXPECTED].update(
            {
                f"{group}_v": np.array(v),
                f"{group}_loss": np.array(loss),
                f"{group}_per_sample_loss": np.array(per_sample),
            }
        )
        grads_file = f"grads_{group}.npz"
        if grads_file in fixture.expected_files():
            outputs[grads_file] = {k: np.array(g) for k, g in grads.items()}
    if INTERMEDIATES in fixture.expected_files():
        wanted = {k for spec in fixture.groups(INTERMEDIATES).values() for k in spec["keys"]}
        computed = intermediates(fixture, model[1], shared)
        outputs[INTERMEDIATES] = {k: v for k, v in computed.items() if k in wanted}
    return outputs
