"""Parity kind `t5gemma`: the tiny HF T5Gemma encoder fixture, every layer's hidden state.

Also home of `encode_fixture_ids`, the helper the `conditioner` kind uses for its
`prompt_t5_last_hidden_state` (the same encoder, fed the conditioner's own token ids).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.convert.checkpoint import read_checkpoint
from sa3mlx.convert.model import find_checkpoint
from sa3mlx.convert.t5gemma import t5gemma_to_mlx
from sa3mlx.models.config import T5GemmaConfig
from sa3mlx.models.t5gemma import T5GemmaEncoder, t5gemma_from_arrays
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import ParityError, register
from sa3mlx.runtime.precision import parse_dtype

EXPECTED = "expected.npz"


def encoder_from_hf_folder(folder: str | Path, dtype: str = "float32") -> T5GemmaEncoder:
    """An HF T5Gemma folder (config.json + safetensors) -> the MLX encoder, weights in `dtype`."""
    folder = Path(folder)
    arrays = t5gemma_to_mlx(read_checkpoint(find_checkpoint(folder), allow_pickle=False))
    weights = {k: mx.array(v).astype(parse_dtype(dtype)) for k, v in arrays.items()}
    return t5gemma_from_arrays(weights, T5GemmaConfig.load(folder))


def encode_fixture_ids(
    folder: str | Path,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    dtype: str = "float32",
    output_hidden_states: bool = False,
):
    """Run the HF folder's encoder on token ids; returns numpy fp32 (and the hidden-state list)."""
    model = encoder_from_hf_folder(folder, dtype)
    ids = mx.array(np.asarray(input_ids).astype(np.int32))
    mask = mx.array(np.asarray(attention_mask).astype(bool))
    result = model(ids, mask, output_hidden_states=output_hidden_states)
    if not output_hidden_states:
        return np.array(result.astype(mx.float32))
    last, states = result
    return np.array(last.astype(mx.float32)), [np.array(s.astype(mx.float32)) for s in states]


def fixture_ref(reference: str) -> str:
    """`file:key (a note)` -> `file:key`."""
    return reference.split(" (")[0].strip()


def prompt_t5_last_hidden_state(
    fixture: Fixture, file: str = EXPECTED, group: str = "prompt_t5_last_hidden_state"
) -> np.ndarray:
    """The conditioner fixture's raw T5Gemma output, from its params.json inputs."""
    inputs = fixture.inputs(file, group)
    ids = fixture.load(fixture_ref(inputs["input_ids"]))
    mask = fixture.load(fixture_ref(inputs["attention_mask"]))
    return conditioner_prompt_hidden_states(fixture, ids, mask, file, group)


def conditioner_prompt_hidden_states(
    fixture: Fixture,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    file: str = EXPECTED,
    group: str = "prompt_t5_last_hidden_state",
) -> np.ndarray:
    """Drop-in for `sa3mlx.parity.conditioner.prompt_hidden_states`: the encoder the group names."""
    inputs, params = fixture.inputs(file, group), fixture.params(file, group)
    folder = fixture.path(fixture_ref(inputs["t5gemma"]))
    return encode_fixture_ids(folder, input_ids, attention_mask, params.get("model_dtype", "float32"))


@register("t5gemma")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    groups = fixture.groups(EXPECTED)
    inputs = fixture.inputs(EXPECTED)
    params = fixture.params(EXPECTED)
    ids = fixture.load(fixture_ref(inputs["input_ids"]))
    mask = fixture.load(fixture_ref(inputs["attention_mask"]))
    if params.get("attention_mask_dtype", "bool") != "bool":
        raise ParityError(f"{fixture.dir}: unsupported attention_mask_dtype {params['attention_mask_dtype']}")
    if params.get("mask_semantics", "keys_only") != "keys_only":
        raise ParityError(f"{fixture.dir}: unsupported mask_semantics {params['mask_semantics']}")
    last, states = encode_fixture_ids(
        fixture.path(inputs["model"]), ids, mask, params.get("model_dtype", "float32"), output_hidden_states=True
    )
    out = {}
    for name, group in groups.items():
        for key in group["keys"]:
            if key == "last_hidden_state":
                out[key] = last
            elif key.startswith("hidden_states_"):
                out[key] = states[int(key.removeprefix("hidden_states_"))]
            else:
                raise ParityError(f"{fixture.dir}: t5gemma kind does not know key '{key}' (group {name})")
    return {EXPECTED: out}
