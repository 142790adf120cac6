"""T5Gemma encoder keys: HF layout -> `t5gemma.npz` (encoder weights only)."""

from __future__ import annotations

import numpy as np

from sa3mlx.models.config import T5GemmaConfig

ENCODER_PREFIX = "encoder."
IGNORED_PREFIXES = ("decoder.", "lm_head")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def t5gemma_shapes(cfg: T5GemmaConfig) -> dict[str, tuple]:
    """Encoder tensors after dropping the `encoder.` prefix, with their shapes."""
    H, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741 (the paper's names)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"embed_tokens.weight": (cfg.vocab_size, H), "norm.weight": (H,)}
    for i in range(cfg.num_layers):
        layer = {
            "self_attn.q_proj.weight": (q, H),
            "self_attn.k_proj.weight": (kv, H),
            "self_attn.v_proj.weight": (kv, H),
            "self_attn.o_proj.weight": (H, q),
            "mlp.gate_proj.weight": (I, H),
            "mlp.up_proj.weight": (I, H),
            "mlp.down_proj.weight": (H, I),
            "pre_self_attn_layernorm.weight": (H,),
            "post_self_attn_layernorm.weight": (H,),
            "pre_feedforward_layernorm.weight": (H,),
            "post_feedforward_layernorm.weight": (H,),
        }
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def t5gemma_to_mlx(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF T5Gemma tensors -> encoder tensors without prefix (`model.` accepted, decoder dropped)."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        if key.startswith(IGNORED_PREFIXES):
            continue
        out[key.removeprefix(ENCODER_PREFIX)] = value
    return out
