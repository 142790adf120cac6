"""DiT + conditioner keys: the official torch layout and its MLX (`dit.npz`) mapping.

Torch keys here are relative to `model.model.` (the DiT) or absolute for the
conditioner. The MLX names are those of the official MLX runtime's npz files.
"""

from __future__ import annotations

import numpy as np

from sa3mlx.models.config import DiTConfig
from sa3mlx.runtime.layout import SECONDS_FEATURES

DIT_PREFIX = "model.model."
COND_PREFIX = "conditioner.conditioners."
# torch conditioner key -> MLX key
COND_KEYS = {
    "conditioner.conditioners.prompt.padding_embedding": "cond.padding_embedding",
    "conditioner.conditioners.seconds_total.embedder.embedding.1.weight": "cond.seconds_total_weight",
    "conditioner.conditioners.seconds_total.embedder.embedding.1.bias": "cond.seconds_total_bias",
}
CONV_KEYS = ("preprocess_conv.weight", "postprocess_conv.weight")
BUFFER_SUFFIX = "inv_freq"  # frozen RoPE buffers: always stored fp32


def torch_dit_shapes(cfg: DiTConfig) -> dict[str, tuple]:
    """Every DiT tensor of an official checkpoint (without `model.model.`) and its shape."""
    E, C, F, M = cfg.embed_dim, cfg.io_channels, cfg.ff_inner, cfg.num_memory_tokens
    shapes = {
        "to_timestep_embed.0.weight": (E, cfg.timestep_features_dim),
        "to_timestep_embed.0.bias": (E,),
        "to_timestep_embed.2.weight": (E, E),
        "to_timestep_embed.2.bias": (E,),
        "to_cond_embed.0.weight": (E, cfg.cond_token_dim),
        "to_cond_embed.2.weight": (E, E),
        "to_global_embed.0.weight": (E, cfg.global_cond_dim),
        "to_global_embed.2.weight": (E, E),
        "preprocess_conv.weight": (C, C, 1),
        "postprocess_conv.weight": (C, C, 1),
        "transformer.project_in.weight": (E, C),
        "transformer.project_out.weight": (C, E),
        "transformer.memory_tokens": (M, E),
        "transformer.rotary_pos_emb.inv_freq": (cfg.rope_dim // 2,),
        "transformer.global_cond_embedder.0.weight": (E, E),
        "transformer.global_cond_embedder.0.bias": (E,),
        "transformer.global_cond_embedder.2.weight": (6 * E, E),
        "transformer.global_cond_embedder.2.bias": (6 * E,),
    }
    qkv, q, kv = (5, 2, 3) if cfg.differential else (3, 1, 2)
    dh = cfg.dim_head
    for i in range(cfg.depth):
        block = {
            "pre_norm.gamma": (E,),
            "cross_attend_norm.gamma": (E,),
            "ff_norm.gamma": (E,),
            "self_attn.to_qkv.weight": (qkv * E, E),
            "self_attn.to_out.weight": (E, E),
            "self_attn.q_norm.gamma": (dh,),
            "self_attn.k_norm.gamma": (dh,),
            "cross_attn.to_q.weight": (q * E, E),
            "cross_attn.to_kv.weight": (kv * E, E),
            "cross_attn.to_out.weight": (E, E),
            "cross_attn.q_norm.gamma": (dh,),
            "cross_attn.k_norm.gamma": (dh,),
            "ff.ff.0.proj.weight": (2 * F, E),
            "ff.ff.0.proj.bias": (2 * F,),
            "ff.ff.2.weight": (E, F),
            "ff.ff.2.bias": (E,),
            "to_local_embed.0.weight": (E, cfg.local_add_cond_dim),
            "to_local_embed.0.bias": (E,),
            "to_local_embed.2.weight": (E, E),
            "to_local_embed.2.bias": (E,),
            "to_scale_shift_gate": (6 * E,),
        }
        shapes.update({f"transformer.layers.{i}.{k}": v for k, v in block.items()})
    return shapes


def torch_cond_shapes(cond_dim: int) -> dict[str, tuple]:
    names = list(COND_KEYS)
    return {names[0]: (cond_dim,), names[1]: (cond_dim, SECONDS_FEATURES), names[2]: (cond_dim,)}


def dit_key_to_mlx(key: str) -> str:
    """A DiT key (without `model.model.`) -> its name in dit.npz."""
    if key.endswith(".gamma"):
        key = key[: -len("gamma")] + "weight"
    for i in (0, 2):
        key = key.replace(f".to_local_embed.{i}.", f".to_local_embed.seq.{i}.")
    return key


def dit_key_to_torch(key: str) -> str:
    """Inverse of dit_key_to_mlx (norm weights are the only `.weight` of 1-D norm modules)."""
    for i in (0, 2):
        key = key.replace(f".to_local_embed.seq.{i}.", f".to_local_embed.{i}.")
    if key.endswith("norm.weight"):
        key = key[: -len("weight")] + "gamma"
    return key


def dit_tensor_to_mlx(key: str, value: np.ndarray) -> np.ndarray:
    """Torch conv weights are (out, in, k); MLX's are (out, k, in)."""
    return value.transpose(0, 2, 1) if key in CONV_KEYS else value


def mlx_dit_shapes(cfg: DiTConfig, cond_dim: int) -> dict[str, tuple]:
    """The keys and shapes of a converted dit.npz (also the official `dit_*_f16.npz`)."""
    shapes = {}
    for key, shape in torch_dit_shapes(cfg).items():
        shapes[dit_key_to_mlx(key)] = (shape[0], shape[2], shape[1]) if key in CONV_KEYS else shape
    for key, shape in torch_cond_shapes(cond_dim).items():
        shapes[COND_KEYS[key]] = shape
    return shapes


def split_sa3_state(state: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """A full SA3 state dict -> (DiT without prefix, conditioner keys, SAME without prefix)."""
    dit = {k[len(DIT_PREFIX) :]: v for k, v in state.items() if k.startswith(DIT_PREFIX)}
    cond = {k: v for k, v in state.items() if k.startswith(COND_PREFIX)}
    same = {k[len("pretransform.model.") :]: v for k, v in state.items() if k.startswith("pretransform.model.")}
    return dit, cond, same


def dit_to_mlx(dit: dict[str, np.ndarray], cond: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Validated torch DiT + conditioner tensors -> dit.npz arrays (dtype unchanged)."""
    out = {dit_key_to_mlx(k): dit_tensor_to_mlx(k, v) for k, v in dit.items()}
    out.update({COND_KEYS[k]: v for k, v in cond.items()})
    return out


def infer_dit_config(dit: dict[str, np.ndarray]) -> dict:
    """The DiT sizes the weights imply (for a readable config-mismatch message)."""
    depth = len({k.split(".")[2] for k in dit if k.startswith("transformer.layers.")})
    inferred = {"depth": depth}
    probes = {
        "embed_dim": ("transformer.project_in.weight", 0),
        "io_channels": ("transformer.project_in.weight", 1),
        "num_memory_tokens": ("transformer.memory_tokens", 0),
        "timestep_features_dim": ("to_timestep_embed.0.weight", 1),
        "cond_token_dim": ("to_cond_embed.0.weight", 1),
        "local_add_cond_dim": ("transformer.layers.0.to_local_embed.0.weight", 1),
        "ff_inner": ("transformer.layers.0.ff.ff.2.weight", 1),
        "dim_head": ("transformer.layers.0.self_attn.q_norm.gamma", 0),
    }
    for name, (key, axis) in probes.items():
        if key in dit:
            inferred[name] = dit[key].shape[axis]
    qkv = dit.get("transformer.layers.0.self_attn.to_qkv.weight")
    if qkv is not None and "embed_dim" in inferred:
        inferred["differential"] = qkv.shape[0] == 5 * inferred["embed_dim"]
    return inferred
