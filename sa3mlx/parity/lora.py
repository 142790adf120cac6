"""Parity kind `lora`: the per-layer adapter fixtures, the legacy-DoRA extra check, the
include/exclude examples, the tiny DiT's adapted-layer list, and the adapted tiny DiT
(`dit_expected.npz`: DiT-only and end-to-end through the adapted conditioner, per strength)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from sa3mlx.convert.checkpoint import read_safetensors
from sa3mlx.convert.dit import dit_tensor_to_mlx, dit_to_mlx, split_sa3_state
from sa3mlx.lora.checkpoint import apply_lora, read_lora
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.inject import inject_adapters, set_strength
from sa3mlx.lora.layers import AdaptedLayer, wrap
from sa3mlx.lora.svd import svd_bases
from sa3mlx.lora.targeting import adaptable_layers, expand, matches_any, select_layers
from sa3mlx.models.conditioning import Conditioner, build_dit
from sa3mlx.models.config import ModelConfig
from sa3mlx.parity.compare import compare
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import THRESHOLDS_DB, ParityError, register
from sa3mlx.parity.t5gemma import conditioner_prompt_hidden_states

STRENGTH_GROUPS = ("s1", "s05", "s0")
DIT_FILE = "dit_expected.npz"


@register("lora")
def run(fixture: Fixture, materialize: bool = True) -> dict[str, dict]:
    outputs = {"layer_inputs.npz": base_outputs(fixture)}
    for file in fixture.expected_files():
        if file.startswith("layer_") and file not in outputs:
            outputs[file] = layer_outputs(fixture, file, materialize)
    outputs["include_exclude_examples.json"] = include_exclude_examples(fixture)
    outputs["dit_lora_layers.json"] = dit_lora_layers(fixture)
    if DIT_FILE in fixture.expected_files():
        outputs[DIT_FILE] = dit_outputs(fixture, materialize)
    failed = [
        f"{key} ({c.psnr_db:.1f} dB)"
        for key, c in extra_checks(fixture, materialize)
        if not c.passes(THRESHOLDS_DB["lora"])
    ]
    if failed:
        raise ParityError(f"{fixture.dir}: extra_checks failed: {', '.join(failed)}")
    return outputs


def base_layers(fixture: Fixture, file: str, group: str | None = None) -> dict[str, nn.Module]:
    """The fixture's nn.Linear and nn.Conv1d with their base weights (fp32), by checkpoint name."""
    params = fixture.params(file, group)
    weights = fixture.load(fixture.inputs(file, group)["base_weights"])
    lin, conv = params["linear"], params["conv"]
    linear = nn.Linear(lin["in_features"], lin["out_features"], bias=lin["bias"])
    conv1d = nn.Conv1d(
        conv["in_channels"],
        conv["out_channels"],
        conv["kernel_size"],
        stride=conv["stride"],
        padding=conv["padding"],
        dilation=conv["dilation"],
        groups=conv["groups"],
        bias=conv["bias"],
    )
    for name, layer in ((lin["name"], linear), (conv["name"], conv1d)):
        for param in ("weight", "bias"):
            key = f"{name}.{param}"
            if key in weights:
                # fixture names mimic the DiTWrapper ("model.…"); the converter's keys drop "model."
                layer[param] = mx.array(dit_tensor_to_mlx(key.removeprefix("model."), weights[key]))
    return {"linear": linear, "conv": conv1d}


def base_outputs(fixture: Fixture) -> dict[str, np.ndarray]:
    file = "layer_inputs.npz"
    layers = base_layers(fixture, file, "base_outputs")
    inputs = fixture.inputs(file, "base_outputs")
    return {
        "y_linear_base": _run_linear(layers["linear"], fixture.load(inputs["x_linear"])),
        "y_conv_base": _run_conv(layers["conv"], fixture.load(inputs["x_conv"])),
    }


def adapted_layers(fixture: Fixture, file: str, adapters: str, materialize: bool) -> dict[str, AdaptedLayer]:
    """Both fixture layers wrapped with the file's adapter and loaded from the `adapters` checkpoint."""
    params = fixture.params(file)
    lora = read_lora(fixture.path(adapters))
    bases = base_layers(fixture, file)
    names = {"linear": params["linear"]["name"], "conv": params["conv"]["name"]}
    adapted = {}
    for role, base in bases.items():
        layer = wrap(base, lora.config["adapter_type"], params["rank"], params["alpha"], materialize=materialize)
        layer.load_lora_state(lora.layers[names[role]], names[role])
        adapted[role] = layer
    return adapted


def layer_outputs(fixture: Fixture, file: str, materialize: bool = True) -> dict[str, np.ndarray]:
    inputs = fixture.inputs(file)
    layers = adapted_layers(fixture, file, inputs["adapters"], materialize)
    out = {}
    for group in fixture.groups(file):
        if group == "svd_bases":
            out.update(svd_outputs(fixture, file))
        else:
            strength = fixture.params(file, group)["lora_strength"]
            out.update(strength_outputs(fixture, inputs, layers, strength, group))
    return out


def strength_outputs(
    fixture: Fixture, inputs: dict, layers: dict[str, AdaptedLayer], strength: float, suffix: str
) -> dict[str, np.ndarray]:
    for layer in layers.values():
        layer.strength = strength
    conv_w = np.array(layers["conv"].effective_weight()).transpose(0, 2, 1)  # MLX (out,k,in) -> torch
    return {
        f"y_linear_{suffix}": _run_linear(layers["linear"], fixture.load(inputs["x_linear"])),
        f"W_linear_{suffix}": np.array(layers["linear"].effective_weight()),
        f"y_conv_{suffix}": _run_conv(layers["conv"], fixture.load(inputs["x_conv"])),
        f"W_conv_{suffix}": conv_w,
    }


def svd_outputs(fixture: Fixture, file: str) -> dict[str, np.ndarray]:
    rank = fixture.params(file, "svd_bases")["rank"]
    layers = base_layers(fixture, file, "svd_bases")
    out = {}
    for role, layer in layers.items():
        w = np.array(layer.weight)
        w2 = w.transpose(0, 2, 1).reshape(w.shape[0], -1) if w.ndim == 3 else w
        bases = svd_bases(w2, rank)
        out[f"{role}.U"], out[f"{role}.V"] = bases["U"], bases["V"]
    return out


def extra_checks(fixture: Fixture, materialize: bool = True) -> list:
    """Comparisons (key, Comparison) of each extra check's outputs with its `compare_with` file."""
    rows = []
    for check in fixture.spec.get("extra_checks", []):
        reference = fixture.reference(check["compare_with"])
        file = check["compare_with"]
        layers = adapted_layers(fixture, file, check["inputs"]["adapters"], materialize)
        strengths = check["params"]["lora_strength_by_suffix"]["value"]
        produced = {}
        for suffix, strength in strengths.items():
            produced.update(strength_outputs(fixture, check["inputs"], layers, strength, suffix))
        rows += [(f"{check['weights']}:{key}", compare(key, reference[key], produced[key])) for key in check["keys"]]
    return rows


def include_exclude_examples(fixture: Fixture) -> dict:
    file = "include_exclude_examples.json"
    patterns = fixture.params(file, "expand")["patterns"]
    columns = fixture.params(file, "matches_any")["pattern_sets"]
    model = ModelConfig.load(fixture.path("../dit_small/model_config.json"))
    names = [layer.name for layer in adaptable_layers(model.dit, model.conditioner.cond_dim)]
    semantics = fixture.params(file, "substring_semantics")
    return {
        "expand": {p: expand(p) for p in patterns},
        "matches_any": [{"name": n, **{col: matches_any(n, ps) for col, ps in columns.items()}} for n in names],
        "substring_semantics": [
            {"patterns": ps, "name": n, "matches": matches_any(n, ps)}
            for ps in semantics["pattern_lists"]
            for n in semantics["names"]
        ],
    }


def dit_lora_layers(fixture: Fixture) -> dict:
    file = "dit_lora_layers.json"
    params = fixture.params(file)
    model = ModelConfig.load(fixture.path(fixture.inputs(file, "adapted_layers")["model"]))
    cfg = LoRAConfig(
        adapter_type=params["adapter_type"],
        rank=params["rank"],
        alpha=params["alpha"],
        include=params["include"],
        exclude=params["exclude"],
    )
    chosen = select_layers(adaptable_layers(model.dit, model.conditioner.cond_dim), cfg)
    return {"adapted_layers": [layer.name for layer in chosen], "count": len(chosen)}


def _run_linear(layer: nn.Module, x: np.ndarray) -> np.ndarray:
    return np.array(layer(mx.array(x)))


def _run_conv(layer: nn.Module, x: np.ndarray) -> np.ndarray:
    """Fixture inputs are channels-first (B, C, L); MLX convs are channels-last."""
    return np.array(layer(mx.array(x).transpose(0, 2, 1))).transpose(0, 2, 1)


def _lora_config(params: dict) -> LoRAConfig:
    return LoRAConfig(
        adapter_type=params["adapter_type"],
        rank=params["rank"],
        alpha=params["alpha"],
        include=params["include"],
        exclude=params["exclude"],
    )


def adapted_fixture_dit(fixture: Fixture, materialize: bool = True):
    """(DiT, Conditioner, adapters) of `dit_expected.npz`: the base model in fp32, adapters added
    with the file's params on DiT and conditioner, the checkpoint's tensors loaded."""
    refs, params = fixture.inputs(DIT_FILE), fixture.params(DIT_FILE)
    if params.get("lora_layer_filter"):
        raise ParityError(f"{fixture.dir}: lora_layer_filter '{params['lora_layer_filter']}' is not supported")
    if params.get("cfg_scale", 1.0) != 1.0:
        raise ParityError(f"{fixture.dir}: {DIT_FILE} with CFG is not supported (one conditional pass only)")
    config = ModelConfig.load(fixture.path(refs["config"]))
    state, _ = read_safetensors(fixture.path(refs["base_weights"]))
    dit_state, cond_state, _ = split_sa3_state(state)
    dit, cond = build_dit(
        dit_to_mlx(dit_state, cond_state), config.dit, Conditioner.from_config(config.conditioner), mx.float32
    )
    layers = inject_adapters(dit, cond, _lora_config(params), materialize=materialize, announce=False)
    apply_lora(read_lora(fixture.path(refs["adapters"])), layers)  # like load_state_dict(strict=False)
    return dit, cond, layers


def dit_outputs(fixture: Fixture, materialize: bool = True) -> dict[str, np.ndarray]:
    dit, cond, layers = adapted_fixture_dit(fixture, materialize)
    out, hidden = {}, {}
    for group, spec in fixture.groups(DIT_FILE).items():
        inputs, params = fixture.inputs(DIT_FILE, group), fixture.params(DIT_FILE, group)
        set_strength(layers, params["lora_strength"])
        if "cross_attn_cond" in inputs:  # DiT only, base conditioning tensors
            values = [
                _dit_velocity(
                    fixture,
                    dit,
                    layers,
                    inputs,
                    params,
                    fixture.load(inputs["cross_attn_cond"]),
                    fixture.load(inputs["global_cond"]),
                )
            ]
        else:
            conditioning = _adapted_conditioning(fixture, cond, group, inputs, hidden)
            values = (
                conditioning
                if "x" not in inputs
                else [_dit_velocity(fixture, dit, layers, inputs, params, *conditioning)]
            )
        out.update(zip(spec["keys"], values))
    return out


def _adapted_conditioning(
    fixture: Fixture, cond: Conditioner, group: str, inputs: dict, cache: dict
) -> list[np.ndarray]:
    """[cross_attn_cond, global_cond] assembled by the (adapted) conditioner."""
    ids = fixture.load(inputs["prompt_input_ids"])
    mask = fixture.load(inputs["prompt_attention_mask"]).astype(bool)
    cache_key = (inputs["prompt_input_ids"], inputs["prompt_attention_mask"], inputs["t5gemma"])
    if cache_key not in cache:  # the prompt encoder has no adapters: same for every strength
        cache[cache_key] = conditioner_prompt_hidden_states(fixture, ids, mask, DIT_FILE, group)
    assembled = cond.assemble(mx.array(cache[cache_key]), mx.array(mask), fixture.load(inputs["seconds_total"]))
    return [np.array(assembled.cross_attn_cond), np.array(assembled.global_cond)]


def _dit_velocity(
    fixture: Fixture, dit, layers: dict, inputs: dict, params: dict, cross_attn_cond, global_cond
) -> np.ndarray:
    t = fixture.load(inputs["t"])
    low, high = params.get("lora_interval", (0.0, 1.0))
    if not low <= float(t[0]) <= high:  # the official forward disables every adapter: W itself
        set_strength(layers, 0.0)
    v = dit(
        mx.array(fixture.load(inputs["x"])),
        mx.array(t),
        mx.array(cross_attn_cond),
        mx.array(global_cond),
        mx.array(fixture.load(inputs["local_add_cond"])),
    )
    set_strength(layers, params["lora_strength"])
    return np.array(v)
