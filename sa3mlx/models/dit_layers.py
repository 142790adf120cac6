"""The layers of the SA3 DiT: RoPE, self/cross attention (standard and differential),
SwiGLU feed-forward, local-conditioning MLP and the adaLN transformer block.

Module and attribute names follow the converted `dit.npz` keys; the `None` entries in
lists stand for torch's parameter-free SiLU/Identity modules so indices line up.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from sa3mlx.models.attention import attention
from sa3mlx.runtime import kernels

BLOCK_NORM_EPS = 1e-5
QK_NORM_EPS = 1e-6
ROPE_BASE = 10000.0


class RotaryEmbedding(nn.Module):
    """Holds the frozen `inv_freq` buffer [R/2]; angles are positions·inv_freq in fp32."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.inv_freq = 1.0 / (ROPE_BASE ** (mx.arange(0, rope_dim, 2, dtype=mx.float32) / rope_dim))
        self.freeze()

    def tables(self, length: int) -> tuple[mx.array, mx.array]:
        """cos, sin [length, R] for positions 0..length-1 (torch duplicates the angles: [f, f])."""
        angles = mx.arange(length, dtype=mx.float32)[:, None] * self.inv_freq.astype(mx.float32)[None]
        angles = mx.concatenate([angles, angles], axis=-1)
        return mx.cos(angles), mx.sin(angles)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the first R dims of x [B,H,L,D] with half-split (rotate_half) pairing, in fp32 or wider."""
    return kernels.rope(x, cos, sin)


def _heads(x: mx.array, num_heads: int) -> mx.array:
    """[B,L,H·D] -> [B,H,L,D]."""
    b, length, width = x.shape
    return x.reshape(b, length, num_heads, width // num_heads).transpose(0, 2, 1, 3)


def _merge_heads(x: mx.array) -> mx.array:
    b, h, length, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, length, h * d)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm through `kernels.rms_norm` (the native kernel on x86 CPUs); the same parameters."""

    def __call__(self, x: mx.array) -> mx.array:
        return kernels.rms_norm(x, self["weight"], self.eps)


class _AttentionBase(nn.Module):
    def __init__(self, dim: int, num_heads: int, differential: bool):
        super().__init__()
        self.num_heads = num_heads
        self.differential = differential
        self.scale = (dim // num_heads) ** -0.5
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm(dim // num_heads, eps=QK_NORM_EPS)
        self.k_norm = RMSNorm(dim // num_heads, eps=QK_NORM_EPS)

    def _attend(self, queries: list, keys: list, v: mx.array, rope=None, key_mask: mx.array | None = None) -> mx.array:
        """queries/keys: [q] or [q, q_diff] in [B,L,E]; the same norms (and RoPE) for each pair.

        key_mask [B,L] (True = valid) zeroes V at padded keys, the official non-flash fallback:
        padded keys keep their softmax mass, padded queries are computed as usual.
        """
        v = _heads(v, self.num_heads)
        if key_mask is not None:
            v = v * key_mask[:, None, :, None].astype(v.dtype)
        out = None
        for q, k in zip(queries, keys):
            q = self.q_norm(_heads(q, self.num_heads))
            k = self.k_norm(_heads(k, self.num_heads))
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            o = attention(q, k, v, self.scale)
            out = o if out is None else out - o  # differential: SDPA(q,k,v) - SDPA(q_diff,k_diff,v), no λ
        return self.to_out(_merge_heads(out))


class SelfAttention(_AttentionBase):
    """to_qkv: E->3E (q,k,v) or, differential, E->5E (q,k,v,q_diff,k_diff)."""

    def __init__(self, dim: int, num_heads: int, differential: bool):
        super().__init__(dim, num_heads, differential)
        self.to_qkv = nn.Linear(dim, (5 if differential else 3) * dim, bias=False)

    def __call__(self, x: mx.array, rope, key_mask: mx.array | None = None) -> mx.array:
        if self.differential:
            q, k, v, q_diff, k_diff = mx.split(self.to_qkv(x), 5, axis=-1)
            return self._attend([q, q_diff], [k, k_diff], v, rope, key_mask)
        q, k, v = mx.split(self.to_qkv(x), 3, axis=-1)
        return self._attend([q], [k], v, rope, key_mask)


class CrossAttention(_AttentionBase):
    """to_q: E->E (or E->2E = q,q_diff); to_kv: E->2E (k,v) (or E->3E = k,k_diff,v). No mask, no RoPE."""

    def __init__(self, dim: int, num_heads: int, differential: bool):
        super().__init__(dim, num_heads, differential)
        self.to_q = nn.Linear(dim, (2 if differential else 1) * dim, bias=False)
        self.to_kv = nn.Linear(dim, (3 if differential else 2) * dim, bias=False)

    def __call__(self, x: mx.array, context: mx.array) -> mx.array:
        if self.differential:
            q, q_diff = mx.split(self.to_q(x), 2, axis=-1)
            k, k_diff, v = mx.split(self.to_kv(context), 3, axis=-1)
            return self._attend([q, q_diff], [k, k_diff], v)
        k, v = mx.split(self.to_kv(context), 2, axis=-1)
        return self._attend([self.to_q(x)], [k], v)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def __call__(self, x: mx.array) -> mx.array:
        return kernels.swiglu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.ff = [SwiGLU(dim, inner), None, nn.Linear(inner, dim)]

    def __call__(self, x: mx.array) -> mx.array:
        return self.ff[2](self.ff[0](x))


class LocalEmbed(nn.Module):
    """Linear(C+1 -> E), SiLU, Linear(E -> E) on [B,T,C+1]."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.seq = [nn.Linear(in_dim, dim), None, nn.Linear(dim, dim)]

    def __call__(self, x: mx.array) -> mx.array:
        return self.seq[2](kernels.silu(self.seq[0](x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, ff_inner: int, local_dim: int, differential: bool):
        super().__init__()
        self.pre_norm = RMSNorm(dim, eps=BLOCK_NORM_EPS)
        self.self_attn = SelfAttention(dim, num_heads, differential)
        self.cross_attend_norm = RMSNorm(dim, eps=BLOCK_NORM_EPS)
        self.cross_attn = CrossAttention(dim, num_heads, differential)
        self.ff_norm = RMSNorm(dim, eps=BLOCK_NORM_EPS)
        self.ff = FeedForward(dim, ff_inner)
        self.to_local_embed = LocalEmbed(local_dim, dim)
        self.to_scale_shift_gate = mx.zeros((6 * dim,))

    def __call__(
        self,
        x: mx.array,
        context: mx.array,
        adaln: mx.array,
        rope,
        local_cond: mx.array | None = None,
        key_mask: mx.array | None = None,
    ) -> mx.array:
        """x [B,M+T,E]; adaln [B,6E] (global_cond_embedder output); local_cond [B,T,C+1] or None;
        key_mask [B,M+T] (True = valid) for the self-attention, or None."""
        modulation = (self.to_scale_shift_gate + adaln)[:, None, :]
        scale_sa, shift_sa, gate_sa, scale_ff, shift_ff, gate_ff = mx.split(modulation, 6, axis=-1)
        h = self.pre_norm(x) * (1 + scale_sa) + shift_sa
        x = x + self.self_attn(h, rope, key_mask) * kernels.sigmoid(1 - gate_sa)
        x = x + self.cross_attn(self.cross_attend_norm(x), context)
        if local_cond is not None:
            local = self.to_local_embed(local_cond)
            pad = mx.zeros((x.shape[0], x.shape[1] - local.shape[1], x.shape[2]), dtype=local.dtype)
            x = x + mx.concatenate([pad, local], axis=1)  # zero rows over the memory tokens
        h = self.ff_norm(x) * (1 + scale_ff) + shift_ff
        return x + self.ff(h) * kernels.sigmoid(1 - gate_ff)
