"""Parity kind `same`: SAME-S / SAME-L encode, encoder output, decode, chunked variants.

Every call parameter (weights, config, noise switches, chunking) comes from the
fixture's params.json; weights are the fixture's torch safetensors converted with
`sa3mlx.convert.same`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from sa3mlx.convert.same import same_to_mlx, torch_same_shapes
from sa3mlx.convert.validate import validate_shapes
from sa3mlx.models.config import AutoencoderConfig
from sa3mlx.models.same import same_decoder_from_arrays, same_encoder_from_arrays
from sa3mlx.models.same_chunked import decode_chunked_torch, encode_chunked_torch
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import ParityError, register

BAND_ATTENTION = "exact_band"  # the only sliding-window attention implemented (exact)


def build_codec(fixture: Fixture, params: dict):
    """(encoder, decoder) from the group's `weights` and `config`, noise switches as given."""
    cfg = AutoencoderConfig.from_standalone(fixture.load(params["config"]))
    weights = str(fixture.path(params["weights"]))
    state = fixture.load(params["weights"])
    validate_shapes(state, torch_same_shapes(cfg), weights, "SAME codec")
    encoder_arrays, decoder_arrays = same_to_mlx(state)
    encoder = same_encoder_from_arrays(
        encoder_arrays, cfg, weights, mask_noise=float(params.get("encoder_mask_noise", 0.0))
    )
    decoder = same_decoder_from_arrays(
        decoder_arrays,
        cfg,
        weights,
        mask_noise=float(params.get("decoder_mask_noise", 0.0)),
        noise_regularize=bool(params.get("bottleneck_noise_regularize", False)),
    )
    return encoder, decoder


def run_group(fixture: Fixture, file: str, group: str, codecs: dict) -> np.ndarray:
    params = fixture.params(file, group)
    call = fixture.groups(file)[group]["call"]
    method = params.get("sliding_window_attention", BAND_ATTENTION)
    if method != BAND_ATTENTION:
        raise ParityError(f"{group}: sliding-window attention '{method}' is not implemented")
    key = (
        params["weights"],
        params["config"],
        params.get("encoder_mask_noise"),
        params.get("decoder_mask_noise"),
        params.get("bottleneck_noise_regularize"),
    )
    if key not in codecs:
        codecs[key] = build_codec(fixture, params)
    encoder, decoder = codecs[key]
    inputs = {name: fixture.load(ref) for name, ref in fixture.inputs(file, group).items()}
    chunked = bool(params.get("chunked", False))
    if call.startswith("encoder("):
        out = encoder.features(mx.array(inputs["audio"]))
    elif call.startswith("AudioAutoencoder.encode_audio"):
        audio = inputs["audio"]
        out = (
            encode_chunked_torch(encoder, audio, params["chunk_size"], params["overlap"])
            if chunked
            else encoder(mx.array(audio))
        )
    elif call.startswith("AudioAutoencoder.decode_audio"):
        latents = inputs["latents"]
        out = (
            decode_chunked_torch(decoder, latents, params["chunk_size"], params["overlap"])
            if chunked
            else decoder(mx.array(latents))
        )
    else:
        raise ParityError(f"{group}: unknown call '{call}'")
    return np.array(out)


@register("same")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    outputs, codecs = {}, {}
    for file in fixture.expected_files():
        values = outputs.setdefault(file, {})
        for group, spec in fixture.groups(file).items():
            result = run_group(fixture, file, group, codecs)
            for key in spec["keys"]:
                values[key] = result
    return outputs
