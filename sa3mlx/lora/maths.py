"""The adapters' effective-weight maths on 2-D weights (fan_out, fan_in), as the official
parametrisation computes it, and the row/column-norm identities of the unmaterialised form.

s = alpha/rank, λ = strength. LoRA/-xs: W + s·λ·Δ, Δ added in the base's compute dtype.
DoRA/BoRA (incl. -xs): V = W + s·λ·Δ in fp32, normalised (‖·‖ + 1e-12, added, not max'ed),
times the magnitudes, cast back; at λ == 0 the base weight is returned unchanged.
"""

from __future__ import annotations

import mlx.core as mx

from sa3mlx.lora.types import AdapterKind
from sa3mlx.runtime.precision import compute_dtype

NORM_EPS = 1e-12


def mlx_weight_to_2d(weight):
    """An MLX Linear (out, in) or Conv1d (out, k, in) weight (mx or numpy) as torch's 2-D adapter view
    (out, in·k), input-channel-major."""
    if weight.ndim == 2:
        return weight
    return weight.transpose(0, 2, 1).reshape(weight.shape[0], -1)


def mlx_weight_from_2d(w2, shape: tuple):
    """Inverse of mlx_weight_to_2d for an MLX weight of `shape`."""
    if len(shape) == 2:
        return w2
    out, taps, inp = shape
    return w2.reshape(out, inp, taps).transpose(0, 2, 1)


def low_rank_factors(kind: AdapterKind, p: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """(left (fan_out, r), right (r, fan_in)) with Δ = left @ right: B, A or U·M_xs, Vᵀ."""
    if kind.xs:
        return p["U"] @ p["M_xs"], p["V"].T
    return p["lora_B"], p["lora_A"]


def effective_weight_2d(
    w2: mx.array, kind: AdapterKind, p: dict[str, mx.array], scale: float, strength: float
) -> mx.array:
    """The adapted weight (fan_out, fan_in) in the base's compute dtype."""
    dtype = compute_dtype(w2.dtype)
    if kind.directional and strength == 0:
        return w2.astype(dtype)
    left, right = low_rank_factors(kind, p)
    delta = (scale * strength) * (left @ right)
    if not kind.directional:
        return w2.astype(dtype) + delta.astype(dtype)
    v = w2.astype(mx.float32) + delta
    if kind.norm == "rows":
        v = v / (mx.linalg.norm(v, axis=1, keepdims=True) + NORM_EPS) * p["magnitude"][:, None]
    elif kind.norm == "cols":
        v = v / (mx.linalg.norm(v, axis=0, keepdims=True) + NORM_EPS) * p["magnitude"][None, :]
    else:
        h = p["magnitude_r"][:, None] * (v / (mx.linalg.norm(v, axis=1, keepdims=True) + NORM_EPS))
        v = h / (mx.linalg.norm(h, axis=0, keepdims=True) + NORM_EPS) * p["magnitude_c"][None, :]
    return v.astype(dtype)


def base_squares(w2: mx.array, kind: AdapterKind) -> dict[str, mx.array]:
    """The terms of `direction_gains` that only the frozen base weight decides (Σ W² per row; per
    column for "cols"), to compute once instead of in every call: the same operations, so the same
    values ("both" weighs its columns by the row gains, so it has none)."""
    w = w2.astype(mx.float32)
    squares = {}
    if kind.norm == "rows":
        squares["rows"] = mx.sum(w * w, axis=1)
    elif kind.norm == "cols":
        squares["cols"] = mx.ones((w.shape[0],), mx.float32) @ (w * w)
    return squares


def direction_gains(
    w2: mx.array,
    kind: AdapterKind,
    p: dict[str, mx.array],
    scale: float,
    strength: float,
    squares: dict[str, mx.array] | None = None,
    w_right: mx.array | None = None,
) -> tuple[mx.array | None, mx.array | None]:
    """(row gain (fan_out,) or None, column gain (fan_in,) or None) such that the DoRA/BoRA weight
    is diag(row)·(W + c·ΔL·ΔR)·diag(col), c = s·λ, from the norm identities (no (out, in) Δ):
    ‖V‖²_row = Σ W² + 2c·rowsum((W Rᵀ) ⊙ L) + c²·rowsum((L R Rᵀ) ⊙ L), and per column with weights q
    ‖diag(√q)V‖²_col = qᵀ(W⊙W) + 2c·colsum(R ⊙ ((q⊙L)ᵀ W)) + c²·colsum(R ⊙ (Lᵀ(q⊙L) R)).
    `squares`: `base_squares(w2, kind)`, computed beforehand (else here); `w_right`: W·Rᵀ, likewise."""
    left, right = low_rank_factors(kind, p)
    c = scale * strength
    w = w2.astype(mx.float32)
    squares = squares or {}
    row = col = None
    if kind.norm in ("rows", "both"):
        sq = (
            (squares["rows"] if "rows" in squares else mx.sum(w * w, axis=1))
            + 2 * c * mx.sum((w @ right.T if w_right is None else w_right) * left, axis=1)
            + c * c * mx.sum((left @ (right @ right.T)) * left, axis=1)
        )
        magnitude = p["magnitude"] if kind.norm == "rows" else p["magnitude_r"]
        row = magnitude / (mx.sqrt(mx.maximum(sq, 0.0)) + NORM_EPS)
    if kind.norm in ("cols", "both"):
        q = mx.ones((w.shape[0],), mx.float32) if row is None else row * row
        ql = left * q[:, None]
        sq = (
            (squares["cols"] if "cols" in squares else q @ (w * w))
            + 2 * c * mx.sum(right * (ql.T @ w), axis=0)
            + c * c * mx.sum(right * ((left.T @ ql) @ right), axis=0)
        )
        magnitude = p["magnitude"] if kind.norm == "cols" else p["magnitude_c"]
        col = magnitude / (mx.sqrt(mx.maximum(sq, 0.0)) + NORM_EPS)
    return row, col
