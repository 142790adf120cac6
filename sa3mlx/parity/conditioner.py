"""Parity kind `conditioner`: the seconds_total conditioner, learned prompt padding and the
end-to-end assembly of `conditioner/`.

The prompt keys (`prompt_t5_last_hidden_state`, `prompt_embedding`, end-to-end
`cross_attn_cond`) run the fixture's T5Gemma encoder through the `t5gemma` kind's helpers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from sa3mlx.convert.checkpoint import read_safetensors
from sa3mlx.convert.dit import COND_KEYS
from sa3mlx.models.conditioning import COND_PREFIX, Conditioner
from sa3mlx.models.fourier import expo_frequencies
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import register
from sa3mlx.parity.t5gemma import conditioner_prompt_hidden_states as prompt_hidden_states
from sa3mlx.parity.t5gemma import fixture_ref, prompt_t5_last_hidden_state

FILE = "expected.npz"


def conditioner_weights(fixture: Fixture) -> dict[str, mx.array]:
    """The `cond.*` arrays (without prefix) of the checkpoint the end-to-end group names."""
    source = fixture.inputs(FILE, "end_to_end")["weights"].split(":")[0]
    state, _ = read_safetensors(fixture.path(source))
    return {COND_KEYS[k][len(COND_PREFIX) :]: mx.array(v) for k, v in state.items() if k in COND_KEYS}


def make_conditioner(weights: dict, cond_dim: int, min_val: float, max_val: float) -> Conditioner:
    cond = Conditioner(cond_dim, min_val, max_val)
    cond.load_weights(list(weights.items()), strict=True)
    return cond


def _seconds_groups(fixture: Fixture, weights: dict) -> dict[str, np.ndarray]:
    out = {}
    for group in ("seconds_clamped_normalized", "seconds_fourier_features", "seconds_embedding"):
        params = fixture.params(FILE, group)
        cond = make_conditioner(weights, params.get("output_dim", 768), params["min_val"], params["max_val"])
        seconds = fixture.load(fixture.inputs(FILE, group)["seconds"].split()[0])
        value = {
            "seconds_clamped_normalized": cond.normalized_seconds,
            "seconds_fourier_features": cond.seconds_features,
            "seconds_embedding": cond.seconds_embedding,
        }[group](seconds)
        out[group] = np.array(value)
    params = fixture.params(FILE, "seconds_expo_freqs")
    out["seconds_expo_freqs"] = expo_frequencies(params["fourier_dim"], params["min_freq"], params["max_freq"])
    return out


def _apply_padding(fixture: Fixture, cond: Conditioner) -> np.ndarray:
    refs = fixture.inputs(FILE, "apply_padding_out")
    hidden, mask = fixture.load(refs["hidden"]), fixture.load(refs["hidden_mask"])
    return np.array(cond.apply_padding(mx.array(hidden), mx.array(mask)))


def _end_to_end(fixture: Fixture, cond: Conditioner) -> dict[str, np.ndarray]:
    refs = fixture.inputs(FILE, "end_to_end")
    ids = fixture.load(refs["input_ids"])
    mask = fixture.load(refs["attention_mask"].split()[0]).astype(bool)
    seconds = fixture.load(refs["seconds_total"])
    hidden = prompt_hidden_states(fixture, ids, mask)
    inputs = cond.assemble(mx.array(hidden), mx.array(mask), seconds)
    return {
        "global_cond": np.array(inputs.global_cond),
        "cross_attn_mask": np.array(inputs.cross_attn_mask),
        "cross_attn_cond": np.array(inputs.cross_attn_cond),
    }


def _prompt_groups(fixture: Fixture, cond: Conditioner) -> dict[str, np.ndarray]:
    hidden = prompt_t5_last_hidden_state(fixture, FILE)
    mask_ref = fixture_ref(fixture.inputs(FILE, "prompt_embedding")["attention_mask"])
    mask = fixture.load(mask_ref).astype(bool)
    embedding = cond.apply_padding(mx.array(hidden), mx.array(mask))
    return {"prompt_t5_last_hidden_state": hidden, "prompt_embedding": np.array(embedding)}


@register("conditioner")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    params, weights = fixture.params(FILE, "end_to_end"), conditioner_weights(fixture)
    cond = make_conditioner(weights, params["seconds_output_dim"], params["seconds_min_val"], params["seconds_max_val"])
    out = _seconds_groups(fixture, weights)
    out["apply_padding_out"] = _apply_padding(fixture, cond)
    out.update(_prompt_groups(fixture, cond))
    out.update(_end_to_end(fixture, cond))
    return {FILE: out}
