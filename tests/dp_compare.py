"""Comparisons of training states for the data-parallel consistency checks (tests/test_train_distributed.py,
bench/dp_consistency.py).

Why a plain 1-rank run and a 2-rank run can differ by more than rounding on a few elements: AdamW's
first update of an element is lr·g/(|g| + eps). Where the first gradient g is itself of the order of
eps (a near-cancellation of the rows' contributions, by chance a few in 10^5 elements), the update's
derivative is about lr/eps, so the fp32 rounding of g (~1e-6 of the contributions) becomes several
percent of lr: that element's value then differs by up to one first-step update, whatever the
arithmetic (grad_accum 2, another reduction order, other kernels), and with 10 steps of small updates
that one element can set its tensor's PSNR below 90 dB. `eps_scale_elements` names those elements.
"""

import numpy as np

from sa3mlx.parity.compare import psnr_db

EPS_SCALE = 10.0  # |first gradient| below this many AdamW eps: the first update is fp32 noise amplified


def identical(a, b) -> bool:
    """Adapters and every optimizer array byte for byte (two ResumeStates)."""
    if sorted(a.adapter) != sorted(b.adapter) or sorted(a.session["optimizer"]) != sorted(b.session["optimizer"]):
        return False
    same_adapter = all(a.adapter[k].tobytes() == b.adapter[k].tobytes() for k in a.adapter)
    moments_a, moments_b = a.session["optimizer"], b.session["optimizer"]
    return same_adapter and all(
        np.asarray(moments_a[k]).tobytes() == np.asarray(moments_b[k]).tobytes() for k in moments_a
    )


def psnr_by_tensor(a, b, leave_out: dict | None = None) -> dict[str, float]:
    """PSNR (dB) of every adapter tensor of ResumeState b against a, without the elements of
    `leave_out` (key -> bool mask of the elements to drop)."""
    assert sorted(a.adapter) == sorted(b.adapter)
    result = {}
    for key in a.adapter:
        keep = ~leave_out[key] if leave_out and key in leave_out else np.ones(a.adapter[key].shape, bool)
        result[key] = psnr_db(a.adapter[key][keep], b.adapter[key][keep])
    return result


def first_gradients(first_step, beta1: float) -> dict[str, np.ndarray]:
    """The (clipped) gradient of the first AdamW step of every adapter tensor, from the ResumeState
    after step 1: its first moment is m1 = (1 − β1)·g1."""
    moments = first_step.session["optimizer"]
    return {key: np.asarray(moments[f"{key}.m"], np.float64) / (1.0 - beta1) for key in first_step.adapter}


def eps_scale_elements(first_step, beta1: float, eps: float, scale: float = EPS_SCALE) -> dict[str, np.ndarray]:
    """key -> mask of the elements whose first gradient was nonzero and below `scale`·eps."""
    return {key: (g != 0) & (np.abs(g) < scale * eps) for key, g in first_gradients(first_step, beta1).items()}


def worst(psnr: dict[str, float]) -> tuple[str, float]:
    key = min(psnr, key=psnr.get)
    return key, psnr[key]
