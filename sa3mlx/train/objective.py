"""The training objective: rectified-flow noising, CFG dropout, local (inpainting) conditioning,
loss masks, loss normalisation and the masked loss reduction, as the official step computes them.

Conventions (t = 1 is noise): `x_t = (1 − t)·x0 + t·noise`, target velocity `noise − x0`.
Local conditioning is either underfit's loop convention (`inpaint_mask` None: an all-ones mask
with zero context, loss on the padding mask) or an inpainting mask [B,1,T] (1 = kept context,
0 = generated) with the masked latents as context and the loss only where generated.

Two weights share the name `mask_loss_weight` upstream; here they are apart:
- `padding_loss_weight` (underfit / official `compute_masked_loss` without attention masking):
  per sample `(Σ signal + w·Σ rest) / (n_signal + w·n_rest + 1e-8)`, rest = outside the loss mask;
- `context_loss_weight` (the official `mask_loss_weight` with attention masking): adds
  `w·mean_b(Σ mse·ctx / (Σ_t ctx·C + 1e-8))`, ctx = inpaint_mask ∧ padding_mask.

Random draws (timesteps, noise, dropout, masks) are made on the host from a numpy Generator;
the array maths below is pure MLX so it can run inside the compiled step.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

COUNT_EPS = 1e-8  # the official constant added to every per-sample element count
MASK_TYPES = ("segments", "full", "causal")  # order of inpaint_mask_probabilities
MAX_MASK_SEGMENTS = 10  # official `max_mask_segments` default


@dataclass(frozen=True)
class ObjectiveConfig:
    cfg_dropout_prob: float = 0.1
    inpaint_mask_probabilities: tuple[float, float, float] | None = None  # None: ones mask, zero context
    dit_padding_mask: bool = False  # the DiT gets padding_mask (V-zeroing); masks zero the padded tail
    loss_on_signal_only: bool = False  # per-sample mean over the loss mask only (no padding term)
    padding_loss_weight: float = 0.0
    context_loss_weight: float = 0.0
    loss_normalization: str = "none"
    loss_norm_eps: float = 1e-6
    count_eps: float = COUNT_EPS

    @classmethod
    def from_train_config(cls, cfg) -> ObjectiveConfig:
        """From a `TrainConfig`: `mask_padding_attention` turns on both the DiT mask and the
        signal-only reduction, as in the official step. Resolve it against the model first
        (`TrainConfig.for_model`): None here is an error, never a silent False."""
        if cfg.mask_padding_attention is None:
            raise ValueError("mask_padding_attention is unresolved: take it from the model (TrainConfig.for_model)")
        return cls(
            cfg_dropout_prob=cfg.cfg_dropout_prob,
            inpaint_mask_probabilities=cfg.inpaint_mask_probabilities,
            dit_padding_mask=cfg.mask_padding_attention,
            loss_on_signal_only=cfg.mask_padding_attention,
            padding_loss_weight=cfg.padding_loss_weight,
            context_loss_weight=cfg.mask_loss_weight,
            loss_normalization=cfg.loss_normalization,
            loss_norm_eps=cfg.loss_norm_eps,
        )

    @property
    def inpainting(self) -> bool:
        return self.inpaint_mask_probabilities is not None


# ---- host-side draws --------------------------------------------------------------------------


def draw_noise(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


def draw_cfg_dropout(rng: np.random.Generator, batch: int, prob: float) -> np.ndarray:
    """Per-sample Bernoulli(prob) [B] bool: True = this sample's cross-attention tokens are zeroed."""
    return rng.random(batch) < prob


def random_inpaint_masks(
    rng: np.random.Generator,
    padding_mask: np.ndarray,
    probabilities,
    mask_padding: bool,
    max_segments: int = MAX_MASK_SEGMENTS,
) -> np.ndarray:
    """The official `random_inpaint_mask` semantics, drawn from `rng`: [B,1,T] fp32, 1 = keep.

    Per sample a type by `probabilities` [segments, full, causal]: segments = randint(1, max)
    possibly-overlapping zero runs, each randint(1, real//n) long at randint(0, real − len);
    full = all zeros; causal = keep a prefix of randint(0, real), zero the rest of the real part.
    `mask_padding` zeroes the padded tail for the non-full types. All randints inclusive.
    """
    padding_mask = np.asarray(padding_mask, bool)
    weights = np.asarray(probabilities, np.float64)
    batch, length = padding_mask.shape
    masks = np.ones((batch, 1, length), np.float32)
    for b in range(batch):
        kind = MASK_TYPES[int(rng.choice(len(MASK_TYPES), p=weights / weights.sum()))]
        real = int(padding_mask[b].sum())
        if kind == "full":
            masks[b] = 0.0
            continue
        if real == 0:
            continue
        if kind == "segments":
            count = int(rng.integers(1, max_segments + 1))
            longest = max(1, real // count)
            for _ in range(count):
                size = int(rng.integers(1, longest + 1))
                start = int(rng.integers(0, real - size + 1))
                masks[b, :, start : start + size] = 0.0
        else:
            prefix = int(rng.integers(0, real + 1))
            masks[b, :, prefix:real] = 0.0
        if mask_padding:
            masks[b, :, real:] = 0.0
    return masks


# ---- array maths (MLX) ------------------------------------------------------------------------


def rectified_flow(x0: mx.array, noise: mx.array, t: mx.array) -> tuple[mx.array, mx.array]:
    """(noised, target): x0·(1 − t) + noise·t and noise − x0, t [B]."""
    tb = t.astype(x0.dtype)[:, None, None]
    return x0 * (1 - tb) + noise * tb, noise - x0


def drop_cross_attention(cross_attn_cond: mx.array, drop: mx.array) -> mx.array:
    """Every cross-attention token of the dropped samples set to zero (global_cond is kept)."""
    return mx.where(drop.astype(mx.bool_)[:, None, None], mx.zeros_like(cross_attn_cond), cross_attn_cond)


def local_add_cond(x0: mx.array, inpaint_mask: mx.array | None) -> mx.array:
    """[mask; context] on channels [B,C+1,T]: an inpaint mask with x0·mask, or (None) underfit's
    all-ones mask with zero context."""
    if inpaint_mask is None:
        ones = mx.ones((x0.shape[0], 1, x0.shape[2]), dtype=x0.dtype)
        return mx.concatenate([ones, mx.zeros_like(x0)], axis=1)
    mask = inpaint_mask.astype(x0.dtype)
    return mx.concatenate([mask, x0 * mask], axis=1)


def loss_masks(padding_mask: mx.array, inpaint_mask: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """(loss mask [B,T], context mask [B,T] or None): padding ∧ ¬keep and padding ∧ keep."""
    padding = padding_mask.astype(mx.bool_)
    if inpaint_mask is None:
        return padding, None
    keep = inpaint_mask[:, 0].astype(mx.bool_)
    return padding & ~keep, padding & keep


def _masked_variance(target: mx.array, mask: mx.array, axes: tuple) -> tuple[mx.array, mx.array]:
    """(population variance of target over `axes` where mask, the count of elements masked in)."""
    weight = mx.broadcast_to(mask, target.shape).astype(target.dtype)
    count = mx.sum(weight, axis=axes, keepdims=True)
    safe = mx.maximum(count, 1)
    mean = mx.sum(target * weight, axis=axes, keepdims=True) / safe
    var = mx.sum(mx.square(target - mean) * weight, axis=axes, keepdims=True) / safe
    return var, count


def normalized_mse(
    pred: mx.array, target: mx.array, loss_mask: mx.array, mode: str = "none", eps: float = 1e-6
) -> mx.array:
    """Per-element (pred − target)² [B,C,T], divided inside the loss mask by a (constant) target
    magnitude: `timestep` channel variance per frame, `sample` masked variance per sample,
    `sample_channel` masked variance per (sample, channel); raw outside the mask."""
    mse = mx.square(pred - target)
    if mode == "none":
        return mse
    target = mx.stop_gradient(target)
    mask = loss_mask.astype(mx.bool_)[:, None, :]
    if mode == "timestep":
        centred = target - mx.mean(target, axis=1, keepdims=True)
        magnitude = mx.mean(mx.square(centred), axis=1, keepdims=True) + eps
    elif mode in ("sample", "sample_channel"):
        var, count = _masked_variance(target, mask, (1, 2) if mode == "sample" else (2,))
        magnitude = mx.where(count > 0, var + eps, mx.ones_like(var))
    else:
        raise ValueError(f"unknown loss_normalization '{mode}'")
    return mx.where(mask, mse / magnitude, mse)


def masked_loss(
    mse: mx.array, loss_mask: mx.array, signal_only: bool, padding_weight: float = 0.0, count_eps: float = COUNT_EPS
) -> tuple[mx.array, mx.array]:
    """(batch loss, per-sample loss [B]): reduced per sample, then the mean over the batch."""
    inside = loss_mask.astype(mx.bool_)[:, None, :]
    channels = mse.shape[1]
    zero = mx.zeros_like(mse)
    signal_sum = mx.sum(mx.where(inside, mse, zero), axis=(1, 2))
    signal_count = mx.sum(loss_mask.astype(mse.dtype), axis=1) * channels
    if signal_only:
        per_sample = signal_sum / (signal_count + count_eps)
    else:
        rest_sum = mx.sum(mx.where(inside, zero, mse), axis=(1, 2))
        rest_count = mx.sum((~loss_mask.astype(mx.bool_)).astype(mse.dtype), axis=1) * channels
        w = padding_weight
        per_sample = (signal_sum + w * rest_sum) / (signal_count + w * rest_count + count_eps)
    return mx.mean(per_sample), per_sample


def context_loss(mse: mx.array, context_mask: mx.array, count_eps: float = COUNT_EPS) -> mx.array:
    """mean_b(Σ mse·ctx / (Σ_t ctx·C + 1e-8)); samples without context count 0."""
    inside = context_mask.astype(mx.bool_)[:, None, :]
    total = mx.sum(mx.where(inside, mse, mx.zeros_like(mse)), axis=(1, 2))
    count = mx.sum(context_mask.astype(mse.dtype), axis=1) * mse.shape[1]
    return mx.mean(total / (count + count_eps))


def objective_loss(
    pred: mx.array, target: mx.array, padding_mask: mx.array, inpaint_mask: mx.array | None, cfg: ObjectiveConfig
) -> tuple[mx.array, mx.array]:
    """(loss, per-sample main-term loss [B]) of one prediction, the context term included."""
    loss_mask, context_mask = loss_masks(padding_mask, inpaint_mask)
    mse = normalized_mse(
        pred.astype(mx.float32), target.astype(mx.float32), loss_mask, cfg.loss_normalization, cfg.loss_norm_eps
    )
    loss, per_sample = masked_loss(mse, loss_mask, cfg.loss_on_signal_only, cfg.padding_loss_weight, cfg.count_eps)
    if context_mask is not None and cfg.context_loss_weight > 0:
        loss = loss + cfg.context_loss_weight * context_loss(mse, context_mask, cfg.count_eps)
    return loss, per_sample
