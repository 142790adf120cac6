"""Scaled dot-product attention for every model here (DiT self/cross, SAME), memory-bounded.

    attention(q, k, v, scale, mask=None) = softmax(q·scale @ kᵀ [masked]) @ v,   [B, H, L, D]

On the CPU, for score tensors the fast kernels take (`runtime.kernels.fast_path`), the scores go
through their softmax (MLX's CPU SDPA is this same unfused matmul-softmax-matmul, with a scalar
exp); otherwise MLX's SDPA runs (fused on Metal/CUDA).
When the [B, H, Lq, Lk] fp32 score tensor would exceed `chunk_bytes`, the queries run in
chunks, each under `mx.checkpoint`: every query row's softmax is its own, so the result is
the whole computation's. The forward holds one chunk's scores at a time; the backward
recomputes them per chunk, but MLX's schedule overlaps the chunks, so its peak falls to about
0.6x of the whole form's (tests/test_kernels.py), not to one chunk's.
"""

from __future__ import annotations

import mlx.core as mx

from sa3mlx.runtime import kernels

CHUNK_BYTES = 128 * 2**20  # score-tensor size above which the queries are chunked


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None, chunk_bytes: int = CHUNK_BYTES
) -> mx.array:
    """q [B,H,Lq,D], k/v [B,H,Lk,D]; mask (bool, True = attend) broadcastable to [B,H,Lq,Lk]."""
    B, H, Lq, _ = q.shape
    rows = max(1, chunk_bytes // (4 * B * H * k.shape[2]))
    if rows >= Lq:
        return _attend(q, k, v, scale, mask)
    chunked = mx.checkpoint(lambda q_, k_, v_, *m: _attend(q_, k_, v_, scale, m[0] if m else None))
    outs = []
    for start in range(0, Lq, rows):
        rows_mask = () if mask is None else (_mask_rows(mask, start, start + rows),)
        outs.append(chunked(q[:, :, start : start + rows], k, v, *rows_mask))
    return mx.concatenate(outs, axis=2)


def _mask_rows(mask: mx.array, start: int, stop: int) -> mx.array:
    return mask if mask.ndim < 2 or mask.shape[-2] == 1 else mask[..., start:stop, :]


def _attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    if not kernels.fast_path(q, nbytes=4 * q.size // q.shape[-1] * k.shape[-2]):  # judged by the score tensor
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    scores = (q * scale) @ k.swapaxes(-1, -2)  # the order of MLX's CPU SDPA: scale q first
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return kernels.softmax(scores) @ v
