"""Parity kind `dit`: DiT velocities (plain, CFG/APG/vanilla/negative), 4-step Euler and
ping-pong samples, and the forward intermediates of `dit_small/` and `dit_medium/`."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np

from sa3mlx.convert.checkpoint import read_safetensors
from sa3mlx.convert.dit import dit_to_mlx, split_sa3_state
from sa3mlx.models.conditioning import Conditioner, DiTInputs, build_dit
from sa3mlx.models.config import ModelConfig
from sa3mlx.models.fourier import expo_frequencies
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import register
from sa3mlx.sample.samplers import GuidedVelocity, fixed_noise, sample_euler, sample_pingpong

_ARRAY_REF = re.compile(r"[\w./-]+\.npz:\w+")


def load_fixture_dit(fixture: Fixture, file: str):
    """(DiT, Conditioner) from the folder's weights and config, fp32."""
    refs = fixture.inputs(file)
    config = ModelConfig.load(fixture.path(refs["config"]))
    state, _ = read_safetensors(fixture.path(refs["weights"]))
    dit, cond, _ = split_sa3_state(state)
    return build_dit(dit_to_mlx(dit, cond), config.dit, Conditioner.from_config(config.conditioner), mx.float32)


def _arrays(fixture: Fixture, file: str, group: str) -> dict[str, mx.array]:
    """The group's inputs that name an array (`file.npz:key`); free-text entries are skipped."""
    return {
        name: mx.array(fixture.load(ref))
        for name, ref in fixture.inputs(file, group).items()
        if _ARRAY_REF.fullmatch(ref)
    }


def _velocity(dit, arrays: dict, params: dict) -> GuidedVelocity:
    inputs = DiTInputs(arrays["cross_attn_cond"], arrays["global_cond"], arrays.get("local_add_cond"))
    negative = params.get("uncond_cross_attn_cond", "zeros") == "negative"
    return GuidedVelocity(
        dit,
        inputs,
        cfg_scale=params.get("cfg_scale", 1.0),
        apg_scale=params.get("apg_scale", 1.0),
        negative_cross_attn_cond=arrays["negative_cross_attn_cond"] if negative else None,
        negative_mask=arrays.get("negative_cross_attn_mask") if negative else None,
        cfg_interval=tuple(params.get("cfg_interval", (0.0, 1.0))),
    )


def _sampler_name(fixture: Fixture, file: str, group: str) -> str | None:
    call = fixture.groups(file)[group].get("call", "")
    return {"sample_discrete_euler": "euler", "sample_flow_pingpong": "pingpong"}.get(call.split("(")[0])


def _expected(fixture: Fixture, dit) -> dict[str, np.ndarray]:
    file, out = "expected.npz", {}
    for group, spec in fixture.groups(file).items():
        params, arrays = fixture.params(file, group), _arrays(fixture, file, group)
        velocity = _velocity(dit, arrays, params)
        sampler = _sampler_name(fixture, file, group)
        if sampler == "euler":
            result = sample_euler(velocity, arrays["x"], np.array(arrays["sigmas"]))
        elif sampler == "pingpong":
            noise = fixed_noise(np.array(arrays["noise"]))
            result = sample_pingpong(velocity, arrays["x"], np.array(arrays["sigmas"]), noise)
        else:
            result = velocity(arrays["x"], arrays["t"])
        (key,) = spec["keys"]
        out[key] = np.array(result)
    return out


def _intermediates(fixture: Fixture, dit) -> dict[str, np.ndarray]:
    file, out = "intermediates.npz", {}
    for group, spec in fixture.groups(file).items():
        params = fixture.params(file, group)
        if group == "expo_freqs":
            out["expo_freqs"] = expo_frequencies(params["dim"], params["min_freq"], params["max_freq"])
            continue
        arrays, capture = _arrays(fixture, file, group), {}
        dit(
            arrays["x"],
            arrays["t"],
            arrays["cross_attn_cond"],
            arrays["global_cond"],
            arrays.get("local_add_cond"),
            capture=capture,
        )
        out.update({key: np.array(capture[key]) for key in spec["keys"]})
    return out


@register("dit")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    dit, _ = load_fixture_dit(fixture, "expected.npz")
    outputs = {"expected.npz": _expected(fixture, dit)}
    if "intermediates.npz" in fixture.expected_files():
        outputs["intermediates.npz"] = _intermediates(fixture, dit)
    return outputs
