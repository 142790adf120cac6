"""The T5Gemma prompt encoder: a bidirectional Gemma-2-style transformer (encoder half only).

Parameter names equal the keys of the converted `t5gemma.npz` (HF names without `encoder.`),
so `load_weights(..., strict=True)` works on it. Compute follows HF's eager path: scores in the
model dtype, soft-capped, then masked at padded keys with the dtype minimum (an all-padding row
thus attends uniformly instead of producing NaN), softmax in fp32, RMSNorms in fp32.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from sa3mlx.models.config import T5GemmaConfig
from sa3mlx.runtime import kernels
from sa3mlx.runtime.artifacts import load_mlx_arrays
from sa3mlx.runtime.precision import compute_dtype

SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """x·rsqrt(mean(x²)+eps)·(1+w), computed in fp32, returned in the input dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        scale = 1.0 + self.weight.astype(mx.float32)
        return kernels.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: T5GemmaConfig, sliding: bool):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping
        self.rope_theta = cfg.rope_theta
        self.window = cfg.sliding_window if sliding else None

    def _heads(self, x: mx.array, count: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, count, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, key_valid: mx.array) -> mx.array:
        """x [B,L,H]; key_valid [B,L] bool (True = real token)."""
        B, L, _ = x.shape
        rope = dict(traditional=False, base=self.rope_theta, scale=1.0, offset=0)
        q = mx.fast.rope(self._heads(self.q_proj(x), self.num_heads), self.head_dim, **rope)
        k = mx.fast.rope(self._heads(self.k_proj(x), self.num_kv_heads), self.head_dim, **rope)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k, v = mx.repeat(k, groups, axis=1), mx.repeat(v, groups, axis=1)
        scores = (q @ k.transpose(0, 1, 3, 2)) * self.scale
        if self.softcap:
            scores = mx.tanh(scores / self.softcap) * self.softcap
        allowed = key_valid[:, None, None, :]
        if self.window is not None and self.window < L:
            allowed = mx.logical_and(allowed, window_band(L, self.window)[None, None])
        scores = mx.where(allowed, scores, mx.array(dtype_min(scores.dtype), dtype=scores.dtype))
        weights = kernels.softmax(scores.astype(mx.float32)).astype(q.dtype)
        out = (weights @ v).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out)


def dtype_min(dtype: mx.Dtype) -> float:
    return float(mx.finfo(dtype).min)


def window_band(length: int, window: int) -> mx.array:
    """Bidirectional sliding window: key j visible from query i when |i − j| < window."""
    pos = mx.arange(length)
    return mx.abs(pos[:, None] - pos[None, :]) < window


class GeGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(kernels.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: T5GemmaConfig, sliding: bool):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = SelfAttention(cfg, sliding)
        self.mlp = GeGLU(H, cfg.intermediate_size)
        self.pre_self_attn_layernorm = GemmaRMSNorm(H, eps)
        self.post_self_attn_layernorm = GemmaRMSNorm(H, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps)

    def __call__(self, h: mx.array, key_valid: mx.array) -> mx.array:
        h = h + self.post_self_attn_layernorm(self.self_attn(self.pre_self_attn_layernorm(h), key_valid))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class T5GemmaEncoder(nn.Module):
    def __init__(self, cfg: T5GemmaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [EncoderLayer(cfg, kind == SLIDING) for kind in cfg.layer_types[: cfg.num_layers]]
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype (the embedding table may stay in its storage dtype)."""
        return self.norm.weight.dtype

    def __call__(self, input_ids: mx.array, attention_mask: mx.array | None = None, output_hidden_states: bool = False):
        """input_ids [B,L] int; attention_mask [B,L] (nonzero = real token; None = all real).

        Returns last_hidden_state [B,L,H], or (last_hidden_state, hidden_states) where
        hidden_states[0] is the scaled embedding, [i] the output of layer i−1, and the last
        entry is the final-normed state (as HF's `output_hidden_states=True`).
        """
        if attention_mask is None:
            attention_mask = mx.ones(input_ids.shape, dtype=mx.bool_)
        key_valid = attention_mask.astype(mx.bool_)
        dtype = self.dtype
        # HF multiplies by sqrt(hidden) as a tensor of the model dtype
        normalizer = mx.array(math.sqrt(self.config.hidden_size), dtype=dtype)
        h = self.embed_tokens(input_ids).astype(dtype) * normalizer
        states = [h]
        for layer in self.layers:
            h = layer(h, key_valid)
            states.append(h)
        h = self.norm(h)
        if not output_hidden_states:
            return h
        states[-1] = h
        return h, states

    def cast_for_compute(self, storage: mx.Dtype) -> T5GemmaEncoder:
        """Cast every weight but the embedding table to the compute dtype of `storage` on this device.

        The table (the bulk of the model: 256k×768) stays in storage; looked-up rows are cast,
        which is exact for fp16/bf16 → fp32.
        """
        target = compute_dtype(storage)
        for module in (*self.layers, self.norm):
            module.set_dtype(target)
        self.embed_tokens.weight = self.embed_tokens.weight.astype(storage)
        return self


def t5gemma_from_arrays(arrays: dict, config: T5GemmaConfig) -> T5GemmaEncoder:
    """Build the encoder from converted arrays (numpy or MLX), strict on names and shapes."""
    weights = {k: v if isinstance(v, mx.array) else mx.array(v) for k, v in arrays.items()}
    storage = weights["embed_tokens.weight"].dtype
    model = T5GemmaEncoder(config)
    model.load_weights(list(weights.items()), strict=True)
    model.cast_for_compute(storage)
    mx.eval(model.parameters())
    model.eval()
    return model


def load_t5gemma(npz_path: str | Path, config: T5GemmaConfig) -> T5GemmaEncoder:
    """The encoder from a converted `t5gemma.npz` (fp32 compute on CPU whatever its storage)."""
    return t5gemma_from_arrays(load_mlx_arrays(npz_path, "T5Gemma weights"), config)
