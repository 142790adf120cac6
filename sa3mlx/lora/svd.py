"""Sign-canonical SVD bases for the -xs adapters (the official convention).

U/V are never stored in adapter checkpoints, so an -xs adapter only reproduces where the same
bases are rebuilt: same base weights, same precision, same sign rule.

The decomposition runs in fp32 on MLX's CPU stream; a tall (or wide) weight is first reduced
by QR to its square factor (what LAPACK's gesdd does internally), which keeps memory at the
weight's size and is several times faster than a full SVD of the (m, m) left basis.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def _thin_svd(w: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(U (m, k), S (k,), V (n, k)), k = min(m, n), of an fp32 matrix."""
    m, n = w.shape
    if m == n:
        u, s, vt = mx.linalg.svd(w, stream=mx.cpu)
        return u, s, vt.T
    if m > n:
        q, r = mx.linalg.qr(w, stream=mx.cpu)
        u, s, vt = mx.linalg.svd(r, stream=mx.cpu)
        return q @ u, s, vt.T
    v, s, u = _thin_svd(w.T)
    return u, s, v


def canonical_svd(weight_2d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U, S, V) of a (fan_out, fan_in) weight in fp32, thin, with the largest-|.| entry of every
    column of U made positive (V's matching column flipped with it)."""
    u, s, v = (np.array(a) for a in _thin_svd(mx.array(np.asarray(weight_2d, dtype=np.float32))))
    peak = np.abs(u).argmax(axis=0)
    signs = np.sign(u[peak, np.arange(u.shape[1])]).astype(np.float32)
    signs[signs == 0] = 1.0
    return u * signs[None, :], s, v * signs[None, :]


def svd_bases(weight_2d: np.ndarray, max_rank: int) -> dict[str, np.ndarray]:
    """The top `max_rank` columns of the canonical bases: U (fan_out, r), V (fan_in, r), S (r,)."""
    u, s, v = canonical_svd(weight_2d)
    return {
        "U": np.ascontiguousarray(u[:, :max_rank]),
        "V": np.ascontiguousarray(v[:, :max_rank]),
        "S": np.ascontiguousarray(s[:max_rank]),
    }
