"""Optimisation of the adapter parameters: AdamW, learning-rate schedules, clipping, accumulation.

AdamW is `mlx.optimizers.AdamW` with `bias_correction=True`, which is torch's AdamW: the
decoupled decay `p·(1 − lr·wd)` is applied first, then the bias-corrected Adam step
`lr/(1−β1^k)·m / (√v/√(1−β2^k) + eps)`; one group over every adapter tensor, magnitudes included.
Every piece has `state_dict()` / `load_state_dict()` of plain values or fp32 arrays, so a resumed
run continues bit-exactly.

Schedules are functions of k, the number of optimizer steps already taken (0 for the first step);
underfit logs `train/lr` after stepping the scheduler, i.e. `schedule.lr(k + 1)` after step k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from sa3mlx.runtime import kernels

TORCH_ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


# ---- AdamW ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdamWConfig:
    lr: float
    betas: tuple[float, float] = TORCH_ADAMW_DEFAULTS["betas"]
    eps: float = TORCH_ADAMW_DEFAULTS["eps"]
    weight_decay: float = TORCH_ADAMW_DEFAULTS["weight_decay"]

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"AdamW lr must be > 0, got {self.lr}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))


def make_adamw(cfg: AdamWConfig) -> optim.AdamW:
    return optim.AdamW(
        learning_rate=cfg.lr, betas=list(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, bias_correction=True
    )


def _leaves(tree, prefix: str = ""):
    """(dotted path, leaf) of a dict/list tree of arrays, in a stable order."""
    return tree_flatten(tree, prefix=prefix)


def optimizer_state_dict(opt: optim.Optimizer) -> dict[str, np.ndarray]:
    """Every optimizer array (step, learning_rate, each parameter's m and v) as numpy, by path."""
    flat = _leaves(opt.state)
    names = [name for name, _ in flat]
    if len(set(names)) != len(names):
        raise ValueError("optimizer state has colliding parameter paths")
    return {name: np.array(value) for name, value in flat}


def load_optimizer_state(opt: optim.Optimizer, state: dict[str, np.ndarray], params) -> None:
    """Restore `optimizer_state_dict` output for the parameter tree `params` (same structure).
    The optimizer's state dict is refilled in place."""

    def moments(path: str):
        missing = [k for k in (f"{path}.m", f"{path}.v") if k not in state]
        if missing:
            raise KeyError(f"optimizer state lacks {missing}")
        return {"m": mx.array(state[f"{path}.m"]), "v": mx.array(state[f"{path}.v"])}

    paths = [name for name, _ in _leaves(params)]
    expected = {"step", "learning_rate"} | {f"{p}.{s}" for p in paths for s in ("m", "v")}
    extra = sorted(set(state) - expected)
    if extra:
        raise KeyError(f"optimizer state has entries for unknown parameters: {extra[:5]}")
    tree = _rebuild(params, "", moments)
    tree["step"] = mx.array(state["step"])
    tree["learning_rate"] = mx.array(state["learning_rate"])
    # in place: a step compiled with `inputs=opt.state` keeps seeing the same dict
    opt.state.clear()
    opt.state.update(tree)


def _rebuild(tree, prefix: str, leaf_fn):
    if isinstance(tree, dict):
        return {k: _rebuild(v, f"{prefix}.{k}" if prefix else str(k), leaf_fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_rebuild(v, f"{prefix}.{i}" if prefix else str(i), leaf_fn) for i, v in enumerate(tree)]
    return leaf_fn(prefix)


# ---- learning-rate schedules ------------------------------------------------------------------


class ConstantLR:
    name = "none"

    def __init__(self, lr: float):
        self.lr_value = float(lr)

    def lr(self, k: int) -> float:
        return self.lr_value

    def state_dict(self) -> dict:
        return {"type": self.name}

    def load_state_dict(self, state: dict) -> None:
        _check_type(self, state)


class InverseLR:
    """lr_k = (1 − warmup^(k+1)) · max(final_lr, lr·(1 + k/inv_gamma)^(−power)), in float64."""

    name = "inverse"

    def __init__(
        self, lr: float, inv_gamma: float = 1.0, power: float = 1.0, warmup: float = 0.0, final_lr: float = 0.0
    ):
        if not 0.0 <= warmup < 1.0:
            raise ValueError(f"InverseLR warmup must be in [0, 1), got {warmup}")
        self.lr_value, self.inv_gamma, self.power = float(lr), float(inv_gamma), float(power)
        self.warmup, self.final_lr = float(warmup), float(final_lr)

    def lr(self, k: int) -> float:
        ramp = 1.0 - self.warmup ** (k + 1)
        decay = (1.0 + k / self.inv_gamma) ** -self.power
        return ramp * max(self.final_lr, self.lr_value * decay)

    def state_dict(self) -> dict:
        return {"type": self.name}

    def load_state_dict(self, state: dict) -> None:
        _check_type(self, state)


@dataclass
class WSDPlan:
    """A wall-clock budget frozen into steps: warm-up, stable, decay (all in optimizer steps)."""

    total_steps: int
    warmup_steps: int
    decay_steps: int
    seconds_per_step: float


class WarmupStableDecay:
    """Warm-up / stable / decay over a wall-clock budget (`max_minutes`).

    Linear warm-up over the first `warmup_frac` of the steps, constant, then linear decay over
    the last `decay_frac` to `final_ratio`·lr. The budget becomes a step count once, when
    `freeze` is given a measured step time; the plan and the elapsed training seconds (which
    count across resumes) live in the state, so the schedule itself is step-based and resumes
    bit-exactly. Before `freeze` the schedule has no plan and `lr` raises.
    """

    name = "wsd"

    def __init__(
        self,
        lr: float,
        max_minutes: float,
        warmup_frac: float = 0.02,
        decay_frac: float = 0.2,
        final_ratio: float = 0.1,
    ):
        if not max_minutes > 0:
            raise ValueError(f"warmup-stable-decay needs a positive max_minutes, got {max_minutes}")
        self.lr_value, self.max_minutes = float(lr), float(max_minutes)
        self.warmup_frac, self.decay_frac, self.final_ratio = warmup_frac, decay_frac, final_ratio
        self.plan: WSDPlan | None = None
        self.elapsed_seconds = 0.0

    @property
    def budget_seconds(self) -> float:
        return self.max_minutes * 60.0

    def add_elapsed(self, seconds: float) -> None:
        self.elapsed_seconds += float(seconds)

    def freeze(self, seconds_per_step: float, steps_done: int = 0) -> WSDPlan:
        """Turn the time left into steps: steps_done + (budget − elapsed) / seconds_per_step."""
        if self.plan is not None:
            return self.plan
        if not seconds_per_step > 0:
            raise ValueError(f"step time must be positive, got {seconds_per_step}")
        left = max(0.0, self.budget_seconds - self.elapsed_seconds)
        total = max(1, steps_done + int(left // seconds_per_step))
        self.plan = WSDPlan(
            total_steps=total,
            warmup_steps=max(1, math.ceil(self.warmup_frac * total)),
            decay_steps=max(1, math.ceil(self.decay_frac * total)),
            seconds_per_step=float(seconds_per_step),
        )
        return self.plan

    def lr(self, k: int) -> float:
        if self.plan is None:
            raise RuntimeError("warmup-stable-decay: freeze() the plan from a measured step time first")
        p = self.plan
        if k < p.warmup_steps:
            return self.lr_value * (k + 1) / p.warmup_steps
        decay_start = p.total_steps - p.decay_steps
        if k < decay_start:
            return self.lr_value
        done = min(k - decay_start + 1, p.decay_steps) / p.decay_steps
        return self.lr_value * (1.0 - (1.0 - self.final_ratio) * done)

    def finished(self, steps_done: int) -> bool:
        return self.plan is not None and steps_done >= self.plan.total_steps

    def state_dict(self) -> dict:
        return {
            "type": self.name,
            "plan": asdict(self.plan) if self.plan else None,
            "elapsed_seconds": self.elapsed_seconds,
        }

    def load_state_dict(self, state: dict) -> None:
        _check_type(self, state)
        self.plan = WSDPlan(**state["plan"]) if state.get("plan") else None
        self.elapsed_seconds = float(state["elapsed_seconds"])


SCHEDULES = ("none", "inverse", "wsd")


def make_schedule(name: str, lr: float, options: dict | None = None):
    """`none` (constant), `inverse` (InverseLR: inv_gamma, power, warmup, final_lr) or `wsd`
    (max_minutes required; warmup_frac, decay_frac, final_ratio)."""
    options = dict(options or {})
    classes = {"none": ConstantLR, "inverse": InverseLR, "wsd": WarmupStableDecay}
    if name not in classes:
        raise ValueError(f"unknown lr schedule '{name}'; expected one of {', '.join(SCHEDULES)}")
    try:
        return classes[name](lr, **options)
    except TypeError as e:
        raise ValueError(f"lr schedule '{name}': bad options {sorted(options)} ({e})") from None


def _check_type(schedule, state: dict) -> None:
    if state.get("type") != schedule.name:
        raise ValueError(f"resume state is for lr schedule '{state.get('type')}', not '{schedule.name}'")


# ---- gradients --------------------------------------------------------------------------------


def global_norm(tree) -> mx.array:
    """sqrt(Σ_p ‖p‖²) over every array of a tree, in fp32 (underfit's grad norm and lora magnitude)."""
    leaves = [v for _, v in tree_flatten(tree)]
    if not leaves:
        return mx.array(0.0, mx.float32)
    if kernels.all_native(leaves):  # one primitive over every leaf, its sums in float64
        return mx.sqrt(mx.sum(kernels.sum_squares(leaves)))
    squares = [mx.sum(mx.square(v.astype(mx.float32))) for v in leaves]
    return mx.sqrt(sum(squares[1:], squares[0]))


def clip_scale(total: mx.array, max_norm: float) -> mx.array:
    """torch's clip factor min(1, max_norm / (total + 1e-6)) for a gradient norm `total`."""
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    return mx.minimum(mx.array(max_norm, mx.float32) / (total + 1e-6), 1.0)


def clip_grad_norm(grads, max_norm: float | None):
    """torch's clip_grad_norm_: scale by min(1, max_norm / (‖g‖ + 1e-6)); returns (grads, post-clip norm).

    `max_norm` None or 0 disables clipping (the norm is then of the unclipped gradients).
    """
    if not max_norm:
        return grads, global_norm(grads)
    coef = clip_scale(global_norm(grads), max_norm)
    clipped = tree_map(lambda g: (g * coef).astype(g.dtype), grads)
    return clipped, global_norm(clipped)


def guarded_update(optimizer: optim.Optimizer, grads: dict, values: dict, finite: mx.array, grad_clip: float | None):
    """Clip, one optimizer step of `values` (a flat dict of adapter tensors, written in place) and the
    optimizer's state, both kept as they were wherever anything is non-finite (`finite` False, or a
    non-finite gradient). Returns (post-clip grad norm, finite, adapter norm before the update).
    AdamW over fp32 tensors on the CPU takes `native_adamw_update`, the rest MLX's own ops."""
    if _native_update_applies(optimizer, grads, values):
        return native_adamw_update(optimizer, grads, values, finite, grad_clip)
    finite = finite & mx.isfinite(global_norm(grads))
    safe = {k: mx.where(finite, g, mx.zeros_like(g)) for k, g in grads.items()}
    clipped, norm = clip_grad_norm(safe, grad_clip)
    magnitude = global_norm(values)  # before the update, as underfit logs it
    before = _snapshot(optimizer.state)
    updated = optimizer.apply_gradients(clipped, values)
    for key, value in updated.items():
        values[key] = mx.where(finite, value, values[key])
    _select_in_place(optimizer.state, before, finite)
    return norm, finite, magnitude


def _native_update_applies(optimizer: optim.Optimizer, grads: dict, values: dict) -> bool:
    plain_adamw = isinstance(optimizer, optim.AdamW) and optimizer.bias_correction and not optimizer._schedulers
    if not plain_adamw or set(grads) != set(values) or not all(k in optimizer.state for k in values):
        return False
    moments = [optimizer.state[k][s] for k in values for s in ("m", "v")]
    return kernels.all_native([*values.values(), *grads.values(), *moments])


def native_adamw_update(optimizer: optim.AdamW, grads: dict, values: dict, finite: mx.array, grad_clip: float | None):
    """`guarded_update`'s AdamW in two native passes (`runtime/kernels.py`): the gradients' and the values'
    sums of squares, then clip + decay + moments + step + the finite guard over every tensor at once,
    which also sums the clipped gradients' squares. The scalars as mlx.optimizers.AdamW computes them;
    the per-element ops in its order (not bit-identical to MLX's fused kernel: its sums run in another
    order). Compiled, for the 9.2 M values of small-music's adapters on 2 cores: 29-41 ms, MLX's ops 132-196."""
    names = list(values)
    params, gradients = [values[k] for k in names], [grads[k] for k in names]
    total = global_norm(gradients)
    finite = finite & mx.isfinite(total)
    scale = clip_scale(total, grad_clip) if grad_clip else mx.array(1.0, mx.float32)
    magnitude = global_norm(params)  # before the update, as underfit logs it
    old_step = optimizer.state["step"]
    step = old_step + 1
    lr = optimizer.learning_rate.astype(mx.float32)
    b1, b2 = optimizer.betas
    scalars = mx.stack(
        [
            scale.astype(mx.float32),
            (1 - lr * optimizer.weight_decay).astype(mx.float32),
            (lr / (1 - b1**step)).astype(mx.float32),
            mx.rsqrt(1 - b2**step).astype(mx.float32),
            finite.astype(mx.float32),
        ]
    )
    moments = [optimizer.state[k] for k in names]
    new_params, ms, vs, clipped_squares = kernels.adamw(
        scalars, params, gradients, [m["m"] for m in moments], [m["v"] for m in moments], (b1, b2), optimizer.eps
    )
    for key, moment, p, m, v in zip(names, moments, new_params, ms, vs):
        values[key], moment["m"], moment["v"] = p, m, v
    optimizer.state["step"] = mx.where(finite, step, old_step)
    norm = mx.where(finite, mx.sqrt(mx.sum(clipped_squares)), 0.0)
    return norm, finite, magnitude


def _snapshot(state):
    """A copy of a nested dict/list state's containers (the arrays themselves are immutable)."""
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_snapshot(v) for v in state]
    return state


def _select_in_place(state, before, keep_new: mx.array) -> None:
    """state[...] = where(keep_new, state, before), writing into the same containers."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in list(items):
        if isinstance(value, (dict, list)):
            _select_in_place(value, before[key], keep_new)
        else:
            state[key] = mx.where(keep_new, value, before[key])


def accumulate(total, grads):
    """Running sum of micro-batch gradients (`total` None for the first)."""
    return grads if total is None else tree_map(lambda a, b: a + b, total, grads)


def average(total, count: int):
    """The mean gradient of `count` accumulated micro-batches (= gradient of the mean loss)."""
    if count < 1:
        raise ValueError("average of zero micro-batches")
    return total if count == 1 else tree_map(lambda g: g / count, total)
