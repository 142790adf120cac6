"""Layers of the SAME codec's transformer blocks (fp32 throughout).

DyT norms, differential self-attention with DyT qk-norm and partial RoPE, the
GLU feed-forward (SiLU, or sin(pi x) in sinusoidal blocks), one pre-norm block,
and exact band attention. Parameter names follow the converted npz files.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from sa3mlx.models.attention import attention
from sa3mlx.runtime import kernels

SIN_GATE_SCALE = 3.14159265359  # the official constant (rounds to float32 pi)


class DyT(nn.Module):
    """Dynamic tanh norm: gamma * tanh(alpha * x) + beta (alpha is a scalar)."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = mx.full((1,), 4.0)
        self.gamma = mx.ones((dim,))
        self.beta = mx.zeros((dim,))

    def __call__(self, x: mx.array) -> mx.array:
        return self.gamma * mx.tanh(self.alpha * x) + self.beta


class Rope(nn.Module):
    """Rotate-half RoPE on the first `dim` features of each head; `inv_freq` is a frozen buffer."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        """x [..., N, dh]: positions 0..N-1 along axis -2."""
        n, half = x.shape[-2], self.inv_freq.shape[0]
        angles = mx.arange(n, dtype=mx.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = mx.cos(angles), mx.sin(angles)
        x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def band_attention(
    q: mx.array, k: mx.array, v: mx.array, left: int, right: int, scale: float, block: int = 64
) -> mx.array:
    """Exact attention where query i sees keys j with -left <= j - i <= right; [B, H, N, dh].

    Queries run in blocks of `block`, each against its keys plus a left/right halo, so
    memory is O(N * (block + left + right)) instead of O(N^2).
    """
    B, H, N, dh = q.shape
    nb = -(-N // block)
    width = block + left + right
    q = mx.pad(q, [(0, 0), (0, 0), (0, nb * block - N), (0, 0)])
    pad_keys = [(0, 0), (0, 0), (left, nb * block - N + right), (0, 0)]
    index = (mx.arange(nb)[:, None] * block + mx.arange(width)[None, :]).reshape(-1)

    def windows(t: mx.array) -> mx.array:
        t = mx.take(mx.pad(t, pad_keys), index, axis=2).reshape(B, H, nb, width, dh)
        return t.transpose(0, 2, 1, 3, 4).reshape(B * nb, H, width, dh)

    blocks = q.reshape(B, H, nb, block, dh).transpose(0, 2, 1, 3, 4).reshape(B * nb, H, block, dh)
    mask = mx.broadcast_to(_band_mask(N, nb, block, left, right)[None], (B, nb, 1, block, width)).reshape(
        B * nb, 1, block, width
    )
    out = attention(blocks, windows(k), windows(v), scale, mask)
    out = out.reshape(B, nb, H, block, dh).transpose(0, 2, 1, 3, 4).reshape(B, H, nb * block, dh)
    return out[:, :, :N]


def _band_mask(n: int, nb: int, block: int, left: int, right: int) -> mx.array:
    """[nb, 1, block, width] keep-mask; padded query rows keep their window (discarded later)."""
    i = mx.arange(nb)[:, None, None] * block + mx.arange(block)[None, :, None]
    j = mx.arange(nb)[:, None, None] * block - left + mx.arange(block + left + right)[None, None, :]
    delta = j - i
    keep = (delta >= -left) & (delta <= right) & (((j >= 0) & (j < n)) | (i >= n))
    return keep[:, None]


class DiffSelfAttention(nn.Module):
    """Differential attention: SDPA(q, k, v) - SDPA(q_diff, k_diff, v), DyT qk-norm, RoPE after it."""

    def __init__(self, dim: int, dim_heads: int, differential: bool = True):
        super().__init__()
        self.heads, self.dim_heads = dim // dim_heads, dim_heads
        self.differential = differential
        self.to_qkv = nn.Linear(dim, (5 if differential else 3) * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.q_norm = DyT(dim_heads)
        self.k_norm = DyT(dim_heads)

    def __call__(self, x: mx.array, rope: Rope, band: tuple[int, int] | None) -> mx.array:
        B, N, D = x.shape
        sets = 2 if self.differential else 1
        parts = self.to_qkv(x).reshape(B, N, 2 * sets + 1, self.heads, self.dim_heads).transpose(2, 0, 3, 1, 4)
        q = rope(self.q_norm(parts[0::3]))  # [sets, B, H, N, dh]: (q, q_diff) or (q,)
        k = rope(self.k_norm(parts[1::3]))
        v = mx.broadcast_to(parts[2][None], q.shape)
        shape = (sets * B, self.heads, N, self.dim_heads)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        scale = 1.0 / math.sqrt(self.dim_heads)
        if band is None:
            out = attention(q, k, v, scale)
        else:
            out = band_attention(q, k, v, band[0], band[1], scale)
        if self.differential:
            out = out[:B] - out[B:]
        return self.to_out(out.transpose(0, 2, 1, 3).reshape(B, N, D))


class Glu(nn.Module):
    def __init__(self, dim: int, inner: int, sinusoidal: bool):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)
        self.sinusoidal = sinusoidal

    def __call__(self, x: mx.array) -> mx.array:
        if not self.sinusoidal:
            return kernels.swiglu(self.proj(x))
        value, gate = mx.split(self.proj(x), 2, axis=-1)
        return value * mx.sin(SIN_GATE_SCALE * gate)


class FeedForward(nn.Module):
    """`ff.0` = GLU in, `ff.2` = Linear out (index 1 is the official no-op)."""

    def __init__(self, dim: int, inner: int, sinusoidal: bool):
        super().__init__()
        self.ff = [Glu(dim, inner, sinusoidal), nn.Identity(), nn.Linear(inner, dim)]

    def __call__(self, x: mx.array) -> mx.array:
        return self.ff[2](self.ff[0](x))


class SameBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ff(norm(x)); no gates, no adaLN."""

    def __init__(self, dim: int, dim_heads: int, ff_inner: int, sinusoidal: bool, differential: bool = True):
        super().__init__()
        dim_heads = min(dim_heads, dim)
        self.pre_norm = DyT(dim)
        self.self_attn = DiffSelfAttention(dim, dim_heads, differential)
        self.ff_norm = DyT(dim)
        self.ff = FeedForward(dim, ff_inner, sinusoidal)
        self.rope = Rope(dim_heads // 2)

    def __call__(self, x: mx.array, band: tuple[int, int] | None = None) -> mx.array:
        """x [B, N, D]; full attention over N, or band attention when `band` = (left, right)."""
        x = x + self.self_attn(self.pre_norm(x), self.rope, band)
        return x + self.ff(self.ff_norm(x))
