"""SAME codec keys: the official torch layout and the MLX encoder/decoder npz files.

Conversion fuses weight norm (W = g * v / ||v||, norm over (in, k) per output
channel, computed in float64) into a plain `mapping.weight` in MLX conv layout
(out, k, in), and splits the codec into `same_encoder.npz` (encoder + the SoftNorm
encode parameters) and `same_decoder.npz` (decoder + `bottleneck.running_std`).
Every other key keeps its torch name without the `encoder.` / `decoder.` prefix.
"""

from __future__ import annotations

import numpy as np

from sa3mlx.models.config import AutoencoderConfig, SameConfig

ENCODER_BLOCK = 0  # encoder.layers: [resampling block, Transpose, Linear(D->latent), Transpose]
ENCODER_OUT = 2
DECODER_IN = 1  # decoder.layers: [Transpose, Linear(latent->D), Transpose, resampling block]
DECODER_BLOCK = 3
ENCODER_BOTTLENECK = ("bias", "scaling_factor", "running_std")
DECODER_BOTTLENECK = ("running_std",)


def _block_shapes(cfg: SameConfig) -> dict[str, tuple]:
    D, F, dh = cfg.width, cfg.ff_inner, cfg.dim_heads
    qkv = 5 if cfg.differential else 3
    shapes = {
        "ff.ff.0.proj.weight": (2 * F, D),
        "ff.ff.0.proj.bias": (2 * F,),
        "ff.ff.2.weight": (D, F),
        "ff.ff.2.bias": (D,),
        "rope.inv_freq": (dh // 4,),  # RoPE over dim_heads // 2 dims
        "self_attn.to_qkv.weight": (qkv * D, D),
        "self_attn.to_out.weight": (D, D),
    }
    for norm, width in (("pre_norm", D), ("ff_norm", D), ("self_attn.q_norm", dh), ("self_attn.k_norm", dh)):
        shapes.update({f"{norm}.alpha": (1,), f"{norm}.beta": (width,), f"{norm}.gamma": (width,)})
    return shapes


def _resampling_shapes(prefix: str, cfg: SameConfig, map_out: int, map_in: int) -> dict[str, tuple]:
    shapes = {
        f"{prefix}.mapping.weight_g": (map_out, 1, 1),
        f"{prefix}.mapping.weight_v": (map_out, map_in, cfg.mapping_kernel),
        f"{prefix}.mapping.bias": (map_out,),
        f"{prefix}.new_tokens": (1, 1, cfg.width),
    }
    for i in range(cfg.depth):
        shapes.update({f"{prefix}.transformers.{i}.{k}": v for k, v in _block_shapes(cfg).items()})
    return shapes


def torch_same_shapes(cfg: AutoencoderConfig) -> dict[str, tuple]:
    """Every tensor of a standalone SAME checkpoint (no prefix) and its shape."""
    enc, dec, L = cfg.encoder, cfg.decoder, cfg.latent_dim
    shapes = _resampling_shapes(f"encoder.layers.{ENCODER_BLOCK}", enc, enc.width, enc.io_channels)
    shapes |= {f"encoder.layers.{ENCODER_OUT}.weight": (L, enc.width), f"encoder.layers.{ENCODER_OUT}.bias": (L,)}
    shapes |= _resampling_shapes(f"decoder.layers.{DECODER_BLOCK}", dec, dec.io_channels, dec.width)
    shapes |= {f"decoder.layers.{DECODER_IN}.weight": (dec.width, L), f"decoder.layers.{DECODER_IN}.bias": (dec.width,)}
    shapes |= {
        "bottleneck.bias": (1, L, 1),
        "bottleneck.scaling_factor": (1, L, 1),
        "bottleneck.running_std": (1,),
        "bottleneck.noise_scaling_factor": (1, cfg.noise_augment_dim, 1),
    }
    return shapes


def fuse_weight_norm(g: np.ndarray, v: np.ndarray) -> np.ndarray:
    """torch weight_norm(dim=0): W = g * v / ||v|| with the norm over (in, k); in float64."""
    v64 = v.astype(np.float64)
    norm = np.sqrt((v64**2).sum(axis=(1, 2), keepdims=True))
    return (g.astype(np.float64) * v64 / norm).astype(np.float32)


def _half_to_mlx(state: dict[str, np.ndarray], half: str, bottleneck: tuple[str, ...]) -> dict[str, np.ndarray]:
    out = {}
    prefix = f"{half}."
    for key, value in state.items():
        if not key.startswith(prefix) or key.endswith(("weight_g", "weight_v")):
            continue
        out[key[len(prefix) :]] = value
    for key in [k for k in state if k.startswith(prefix) and k.endswith(".weight_v")]:
        base = key[len(prefix) : -len("_v")]
        fused = fuse_weight_norm(state[key[:-1] + "g"], state[key])
        out[base] = fused.transpose(0, 2, 1)  # torch (out, in, k) -> MLX (out, k, in)
    out.update({f"bottleneck.{k}": state[f"bottleneck.{k}"] for k in bottleneck})
    return out


def same_to_mlx(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A validated standalone SAME state dict -> (encoder npz arrays, decoder npz arrays)."""
    return (_half_to_mlx(state, "encoder", ENCODER_BOTTLENECK), _half_to_mlx(state, "decoder", DECODER_BOTTLENECK))
