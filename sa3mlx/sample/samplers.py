"""Rectified-flow sampling with the SA3 DiT: CFG/APG guidance, Euler, ping-pong, init audio
and inpainting paste-back.

A *velocity function* is `f(x [B,C,T], t [B]) -> v`; `GuidedVelocity` builds one from a DiT and
its conditioning (batched cond/uncond when cfg_scale != 1). Guidance happens in denoised space
d = x − t·v: diff = d_c − d_u; vanilla uses diff, APG (default) only its component orthogonal
to d_c (per sample over C×T, fp32); d = d_c + (s − 1)·diff'; v = (x − d)/t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from sa3mlx.models.conditioning import DiTInputs, negative_tokens, unconditional_tokens

APG_EPS = 1e-12  # F.normalize eps
APG_MASKED_EPS = 1e-8  # the clamp of the official projection over the valid frames only
SAMPLERS = {"rectified_flow": "euler", "rf_denoiser": "pingpong"}  # default sampler per objective


def apg_project(diff: mx.array, direction: mx.array, padding_mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(parallel, orthogonal) parts of diff w.r.t. direction, per sample over (C, T), in fp32.

    With padding_mask [B,T] (True = valid) only valid frames define the direction, the norm is
    clamped at 1e-8 instead of 1e-12, and the orthogonal part is zero at padded frames (official).
    """
    dtype = diff.dtype
    diff, direction = diff.astype(mx.float32), direction.astype(mx.float32)
    mask = None if padding_mask is None else padding_mask.astype(mx.float32)[:, None, :]
    if mask is not None:
        direction = direction * mask
    norm = mx.sqrt(mx.sum(direction * direction, axis=(1, 2), keepdims=True))
    unit = direction / mx.maximum(norm, APG_EPS if mask is None else APG_MASKED_EPS)
    parallel = mx.sum(diff * unit, axis=(1, 2), keepdims=True) * unit
    orthogonal = diff - parallel if mask is None else (diff - parallel) * mask
    return parallel.astype(dtype), orthogonal.astype(dtype)


def guide(
    x: mx.array,
    t: mx.array,
    v_cond: mx.array,
    v_uncond: mx.array,
    cfg_scale: float,
    apg_scale: float = 1.0,
    padding_mask: mx.array | None = None,
) -> mx.array:
    """Guided velocity from the conditional and unconditional velocities."""
    sigma = t.astype(x.dtype)[:, None, None]
    d_cond, d_uncond = x - v_cond * sigma, x - v_uncond * sigma
    diff = d_cond - d_uncond
    if apg_scale != 0.0:
        _, orthogonal = apg_project(diff, d_cond, padding_mask)
        diff = orthogonal if apg_scale == 1.0 else apg_scale * orthogonal + (1 - apg_scale) * diff
    return (x - (d_cond + (cfg_scale - 1) * diff)) / sigma


@dataclass
class GuidedVelocity:
    """DiT + conditioning -> velocity function, with classifier-free guidance when cfg_scale != 1.

    The unconditional branch uses zero cross-attention tokens, or `negative_cross_attn_cond`
    (tokens where `negative_mask` is false zeroed), and the same global and local conditioning.
    Guidance is applied iff cfg_interval[0] <= t[0] <= cfg_interval[1], as torch tests t[0] only.
    `padding_mask` [B,T] (True = real frames) goes to the DiT (value-zeroed padding) and to APG.
    """

    dit: Callable
    inputs: DiTInputs
    cfg_scale: float = 1.0
    apg_scale: float = 1.0
    negative_cross_attn_cond: mx.array | None = None
    negative_mask: mx.array | None = None
    cfg_interval: tuple[float, float] = (0.0, 1.0)
    padding_mask: mx.array | None = None

    def _call_dit(self, batch: int, *arrays: mx.array) -> mx.array:
        if self.padding_mask is None:
            return self.dit(*arrays)
        return self.dit(*arrays, padding_mask=mx.concatenate([self.padding_mask] * batch))

    def __call__(self, x: mx.array, t: mx.array) -> mx.array:
        c = self.inputs
        t0 = float(t[0].item())
        if self.cfg_scale == 1.0 or not (self.cfg_interval[0] <= t0 <= self.cfg_interval[1]):
            return self._call_dit(1, x, t, c.cross_attn_cond, c.global_cond, c.local_add_cond)
        uncond = (
            unconditional_tokens(c.cross_attn_cond)
            if self.negative_cross_attn_cond is None
            else negative_tokens(self.negative_cross_attn_cond, self.negative_mask)
        )
        local = None if c.local_add_cond is None else mx.concatenate([c.local_add_cond] * 2)
        v = self._call_dit(
            2,
            mx.concatenate([x, x]),
            mx.concatenate([t, t]),
            mx.concatenate([c.cross_attn_cond, uncond.astype(c.cross_attn_cond.dtype)]),
            mx.concatenate([c.global_cond, c.global_cond]),
            local,
        )
        v_cond, v_uncond = mx.split(v, 2)
        return guide(x, t, v_cond, v_uncond, self.cfg_scale, self.apg_scale, self.padding_mask)


def _step_times(sigmas, i: int, batch: int, dtype) -> tuple[mx.array, mx.array]:
    """(t_i, t_{i+1}) as [B] arrays; sigmas [S+1] (shared) or [B, S+1] (per element)."""
    sigmas = np.asarray(sigmas, np.float32)
    if sigmas.ndim == 1:
        now, nxt = np.full(batch, sigmas[i]), np.full(batch, sigmas[i + 1])
    else:
        now, nxt = sigmas[:, i], sigmas[:, i + 1]
    return mx.array(now, dtype=mx.float32).astype(dtype), mx.array(nxt, dtype=mx.float32).astype(dtype)


def sample_euler(velocity: Callable, x: mx.array, sigmas, callback: Callable | None = None) -> mx.array:
    """x ← x + (t_{i+1} − t_i)·v(x, t_i)."""
    for i in range(np.shape(sigmas)[-1] - 1):
        t, t_next = _step_times(sigmas, i, x.shape[0], x.dtype)
        v = velocity(x, t)
        x = x + (t_next - t)[:, None, None] * v
        mx.eval(x)
        if callback is not None:
            callback(i, x)
    return x


NoiseSource = Callable[[int, tuple, mx.Dtype], mx.array]


def random_noise(key: mx.array | None = None) -> NoiseSource:
    """Fresh N(0, I) per step from `key` (or the global MLX generator)."""
    spine, step_keys = [key], []  # split(spine[i]) -> (spine[i + 1], key of step i)

    def step_key(i: int) -> mx.array | None:
        if key is None:
            return None
        while len(step_keys) <= i:
            following, own = mx.random.split(spine[-1])
            spine.append(following)
            step_keys.append(own)
        return step_keys[i]

    def draw(i: int, shape: tuple, dtype) -> mx.array:
        return mx.random.normal(shape, dtype=dtype, key=step_key(i))

    return draw


def fixed_noise(noises: Sequence) -> NoiseSource:
    """Injected noise: noises[i] is the draw of step i (e.g. the fixtures' `pingpong_noise`)."""
    return lambda i, shape, dtype: mx.array(noises[i]).astype(dtype)


def sample_pingpong(
    velocity: Callable, x: mx.array, sigmas, noise: NoiseSource | None = None, callback: Callable | None = None
) -> mx.array:
    """denoised = x − t_i·v(x, t_i); x = (1 − t_{i+1})·denoised + t_{i+1}·ε_i (ε_last is scaled by 0)."""
    noise = noise or random_noise()
    for i in range(np.shape(sigmas)[-1] - 1):
        t, t_next = _step_times(sigmas, i, x.shape[0], x.dtype)
        denoised = x - t[:, None, None] * velocity(x, t)
        t_next = t_next[:, None, None]
        x = (1 - t_next) * denoised + t_next * noise(i, x.shape, x.dtype)
        mx.eval(x)
        if callback is not None:
            callback(i, x)
    return x


def noised_init(init_latents: mx.array, noise: mx.array, sigma_max: float) -> mx.array:
    """Audio-to-audio start: init·(1 − σmax) + ε·σmax."""
    return init_latents * (1 - sigma_max) + noise * sigma_max


def paste_back(x: mx.array, init_latents: mx.array, keep_mask: mx.array) -> mx.array:
    """Inpainting: kept frames (mask 1, [B,T] or [B,1,T]) take the init latents exactly."""
    mask = mx.array(keep_mask).astype(x.dtype)
    if mask.ndim == 2:
        mask = mask[:, None, :]
    return mask * init_latents + (1 - mask) * x


def sample(
    velocity: Callable,
    noise: mx.array,
    sigmas,
    objective: str = "rectified_flow",
    sampler: str | None = None,
    init_latents: mx.array | None = None,
    keep_mask: mx.array | None = None,
    step_noise: NoiseSource | None = None,
    callback: Callable | None = None,
) -> mx.array:
    """Run the objective's sampler (Euler for rectified_flow, ping-pong for rf_denoiser).

    With init_latents the start is noised_init(init, noise, sigmas[0]) (σmax = the schedule's first
    value); with keep_mask too, kept frames are pasted back at the end (inpainting).
    """
    sampler = sampler or SAMPLERS[objective]
    x = noise
    if init_latents is not None:
        sigma_max = float(np.asarray(sigmas, np.float32)[..., 0].max())
        x = noised_init(init_latents.astype(noise.dtype), noise, sigma_max)
    if sampler == "euler":
        x = sample_euler(velocity, x, sigmas, callback)
    elif sampler == "pingpong":
        x = sample_pingpong(velocity, x, sigmas, step_noise, callback)
    else:
        raise ValueError(f"unknown sampler '{sampler}' (euler, pingpong)")
    if keep_mask is not None and init_latents is not None:
        x = paste_back(x, init_latents.astype(x.dtype), keep_mask)
    return x
