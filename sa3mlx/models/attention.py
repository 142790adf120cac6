"""Scaled dot-product attention for every model here (DiT self/cross, SAME), memory-bounded.

    attention(q, k, v, scale, mask=None) = softmax(q·scale @ kᵀ [masked]) @ v,   [B, H, L, D]

On the CPU, for score tensors the fast kernels take (`runtime.kernels.fast_path`), the scores go
through their softmax (MLX's CPU SDPA is this same unfused matmul-softmax-matmul, with a scalar
exp); otherwise MLX's SDPA runs (fused on Metal/CUDA).
When the [B, H, Lq, Lk] fp32 score tensor would exceed `chunk_bytes`, the queries run in chunks
of rows (each chunk's scores CHUNK_ROWS_BYTES: MLX keeps a few chunks in flight, so smaller chunks
lower the peak at no measurable cost), forward and backward, one chunk after another: every
query row's softmax is its own, so the forward is the whole computation's. The backward
(flash-attention style, `_chunked_vjp`) recomputes each chunk's probabilities P from q, k and v
and accumulates dK and dV over the chunks, so no [B, H, Lq, Lk] tensor is ever kept: a few
chunks' worth of scores at a time.
"""

from __future__ import annotations

import mlx.core as mx

from sa3mlx.runtime import kernels

CHUNK_BYTES = 128 * 2**20  # score-tensor size above which the queries are chunked
CHUNK_ROWS_BYTES = 32 * 2**20  # then the scores of one chunk (medium at crop 4096: 84 rows; peak 4.1 -> 3.6 GB at d2)


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None, chunk_bytes: int = CHUNK_BYTES
) -> mx.array:
    """q [B,H,Lq,D], k/v [B,H,Lk,D]; mask (bool, True = attend) broadcastable to [B,H,Lq,Lk]."""
    B, H, Lq, _ = q.shape
    row_bytes = 4 * B * H * k.shape[2]
    if row_bytes * Lq <= chunk_bytes:
        return _attend(q, k, v, scale, mask)
    rows = max(1, min(chunk_bytes, CHUNK_ROWS_BYTES) // row_bytes)
    return _chunked(rows, scale, mask)(q, k, v)


def _chunks(length: int, rows: int) -> list[tuple[int, int]]:
    return [(start, min(start + rows, length)) for start in range(0, length, rows)]


def _mask_rows(mask: mx.array | None, start: int, stop: int) -> mx.array | None:
    if mask is None or mask.ndim < 2 or mask.shape[-2] == 1:
        return mask
    return mask[..., start:stop, :]


def _probabilities(q: mx.array, k: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    """softmax of the (masked) scores, exactly as `_attend` computes them on the fast path."""
    scores = (q * scale) @ k.swapaxes(-1, -2)  # the order of MLX's CPU SDPA: scale q first
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return kernels.softmax(scores)


def _attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    if not kernels.fast_path(q, nbytes=4 * q.size // q.shape[-1] * k.shape[-2]):  # judged by the score tensor
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return _probabilities(q, k, scale, mask) @ v


def _chunked(rows: int, scale: float, mask: mx.array | None):
    """attention(q, k, v) over query chunks of `rows`, with a backward that keeps no whole score tensor."""

    @mx.custom_function
    def run(q, k, v):
        # each chunk waits for the one before: a few chunks' scores alive at a time, never all of them
        outs = []
        for start, stop in _chunks(q.shape[2], rows):
            q_rows = q[:, :, start:stop] if not outs else mx.depends(q[:, :, start:stop], outs[-1])
            outs.append(_attend(q_rows, k, v, scale, _mask_rows(mask, start, stop)))
        return mx.concatenate(outs, axis=2)

    @run.vjp
    def _chunked_vjp(primals, cotangent, output):
        q, k, v = primals
        dq, dk, dv = [], mx.zeros(k.shape, mx.float32), mx.zeros(v.shape, mx.float32)
        for start, stop in _chunks(q.shape[2], rows):
            # after the previous chunk, dq included (else every chunk's ds waits for the final concatenate)
            q_rows = mx.depends(q[:, :, start:stop], [dk, dv, *dq[-1:]])
            rows_mask = _mask_rows(mask, start, stop)
            p = _probabilities(q_rows, k, scale, rows_mask)
            d_out = cotangent[:, :, start:stop]
            dv = dv + p.swapaxes(-1, -2) @ d_out
            dp = d_out @ v.swapaxes(-1, -2)
            ds = kernels.softmax_vjp(p, dp)
            if rows_mask is not None:
                ds = mx.where(rows_mask, ds, 0.0)
            dq.append((ds @ k) * scale)
            dk = dk + ds.swapaxes(-1, -2) @ (q_rows * scale)
        return mx.concatenate(dq, axis=2).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return run
