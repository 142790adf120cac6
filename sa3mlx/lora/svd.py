"""Sign-canonical SVD bases for the -xs adapters (the official convention).

U/V are never stored in adapter checkpoints, so an -xs adapter only reproduces where the same
bases are rebuilt: same base weights, same precision, same sign rule.
"""

from __future__ import annotations

import numpy as np


def canonical_svd(weight_2d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U, S, V) of a (fan_out, fan_in) weight in fp32, thin, with the largest-|.| entry of every
    column of U made positive (V's matching column flipped with it); V = Vhᵀ."""
    w = np.asarray(weight_2d, dtype=np.float32)
    u, s, vh = np.linalg.svd(w, full_matrices=False)
    peak = np.abs(u).argmax(axis=0)
    signs = np.sign(u[peak, np.arange(u.shape[1])]).astype(np.float32)
    signs[signs == 0] = 1.0
    return u * signs[None, :], s, (vh * signs[:, None]).T


def svd_bases(weight_2d: np.ndarray, max_rank: int) -> dict[str, np.ndarray]:
    """The top `max_rank` columns of the canonical bases: U (fan_out, r), V (fan_in, r), S (r,)."""
    u, s, v = canonical_svd(weight_2d)
    return {"U": np.ascontiguousarray(u[:, :max_rank]), "V": np.ascontiguousarray(v[:, :max_rank]),
            "S": np.ascontiguousarray(s[:max_rank])}
