"""SA3 conditioning: the seconds_total number conditioner, learned prompt padding, and the
assembly of the DiT's conditioning tensors; `load_dit` loads a converted `dit.npz`.

Assembly (torch `get_conditioning_inputs`):
    cross_attn_cond = [prompt tokens (padded rows replaced by padding_embedding); seconds token]
    global_cond     = the seconds token
    local_add_cond  = [inpaint mask; masked latents] on channels (mask 1 = keep)
Guidance: the unconditional branch gets zero cross-attention tokens (or the negative
prompt's tokens with masked positions zeroed) and keeps global_cond.
The prompt hidden states come from the T5Gemma encoder (`sa3mlx.models.t5gemma`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from sa3mlx.models.config import ConditionerConfig, DiTConfig, ModelConfig
from sa3mlx.models.dit import DiT
from sa3mlx.models.fourier import expo_fourier_features, expo_frequencies
from sa3mlx.runtime.artifacts import load_mlx_arrays
from sa3mlx.runtime.layout import MODEL_CONFIG_FILE, SECONDS_FEATURES
from sa3mlx.runtime.precision import STORED, compute_dtype

COND_PREFIX = "cond."  # conditioner keys in dit.npz
FROZEN_FP32_SUFFIX = "inv_freq"  # RoPE buffers stay fp32 whatever the compute dtype


@dataclass
class DiTInputs:
    """The conditioning tensors of one DiT call (batch B)."""

    cross_attn_cond: mx.array  # [B, N+1, cond_dim]
    global_cond: mx.array  # [B, cond_dim]
    local_add_cond: mx.array | None = None  # [B, C+1, T]
    cross_attn_mask: mx.array | None = None  # [B, N+1]; informational, the DiT ignores it


class Conditioner(nn.Module):
    """Holds `padding_embedding`, `seconds_total_weight`, `seconds_total_bias` (dit.npz `cond.*`).

    An optional child module `seconds_linear` (set by the caller, e.g. an adapter wrapping the
    same weight and bias) replaces the plain seconds Linear when present.
    """

    def __init__(self, cond_dim: int = 768, min_seconds: float = 0.0, max_seconds: float = 384.0):
        super().__init__()
        self.min_seconds, self.max_seconds = float(min_seconds), float(max_seconds)
        self.padding_embedding = mx.zeros((cond_dim,))
        self.seconds_total_weight = mx.zeros((cond_dim, SECONDS_FEATURES))
        self.seconds_total_bias = mx.zeros((cond_dim,))
        self._freqs = mx.array(expo_frequencies(SECONDS_FEATURES))

    @classmethod
    def from_config(cls, cfg: ConditionerConfig) -> Conditioner:
        return cls(cfg.cond_dim, cfg.seconds.min_val, cfg.seconds.max_val)

    def normalized_seconds(self, seconds) -> mx.array:
        """clamp(s, min, max) then (s - min)/(max - min), fp32 [K]."""
        s = mx.clip(mx.array(seconds, dtype=mx.float32), self.min_seconds, self.max_seconds)
        return (s - self.min_seconds) / (self.max_seconds - self.min_seconds)

    def seconds_features(self, seconds) -> mx.array:
        return expo_fourier_features(self.normalized_seconds(seconds), self._freqs)

    def seconds_embedding(self, seconds) -> mx.array:
        """[K] seconds -> [K, 1, cond_dim]."""
        features = self.seconds_features(seconds).astype(compute_dtype(self.seconds_total_weight.dtype))
        if "seconds_linear" in self:
            return self.seconds_linear(features)[:, None, :]
        return (features @ self.seconds_total_weight.T + self.seconds_total_bias)[:, None, :]

    def apply_padding(self, hidden: mx.array, mask: mx.array) -> mx.array:
        """Rows where mask is false are replaced by padding_embedding (learned padding mode)."""
        keep = mx.array(mask).astype(mx.bool_)[..., None]
        return mx.where(keep, hidden, self.padding_embedding.astype(hidden.dtype))

    def assemble(
        self, prompt_hidden: mx.array, prompt_mask: mx.array, seconds, local_add_cond: mx.array | None = None
    ) -> DiTInputs:
        """Prompt hidden states [B,N,768] + mask [B,N] + seconds [B] -> the DiT's conditioning."""
        prompt = self.apply_padding(prompt_hidden, prompt_mask)
        seconds_token = self.seconds_embedding(seconds).astype(prompt.dtype)
        mask = mx.array(prompt_mask).astype(mx.float32)
        return DiTInputs(
            cross_attn_cond=mx.concatenate([prompt, seconds_token], axis=1),
            global_cond=seconds_token[:, 0],
            local_add_cond=local_add_cond,
            cross_attn_mask=mx.concatenate([mask, mx.ones((mask.shape[0], 1))], axis=1),
        )


def local_conditioning(mask: mx.array, latents: mx.array) -> mx.array:
    """[mask; latents·mask] on channels: mask [B,T] or [B,1,T] (1 = keep), latents [B,C,T]."""
    mask = mx.array(mask).astype(latents.dtype)
    if mask.ndim == 2:
        mask = mask[:, None, :]
    return mx.concatenate([mask, latents * mask], axis=1)


def text_to_audio_local(batch: int, channels: int, length: int) -> mx.array:
    """Local conditioning without init audio: mask and context all zero ([B, C+1, T])."""
    return mx.zeros((batch, channels + 1, length))


def unconditional_tokens(cross_attn_cond: mx.array) -> mx.array:
    return mx.zeros_like(cross_attn_cond)


def negative_tokens(negative_cross_attn_cond: mx.array, negative_mask: mx.array | None) -> mx.array:
    """Negative-prompt tokens for the unconditional branch; masked-out tokens become 0."""
    if negative_mask is None:
        return negative_cross_attn_cond
    keep = mx.array(negative_mask).astype(mx.bool_)[..., None]
    return mx.where(keep, negative_cross_attn_cond, mx.zeros_like(negative_cross_attn_cond))


def split_dit_arrays(arrays: dict) -> tuple[dict, dict]:
    """dit.npz arrays -> (DiT arrays, conditioner arrays without the `cond.` prefix)."""
    dit = {k: v for k, v in arrays.items() if not k.startswith(COND_PREFIX)}
    cond = {k[len(COND_PREFIX) :]: v for k, v in arrays.items() if k.startswith(COND_PREFIX)}
    return dit, cond


def build_dit(
    arrays: dict, config: DiTConfig, conditioner: Conditioner, dtype: mx.Dtype | str | None = None
) -> tuple[DiT, Conditioner]:
    """Load dit.npz-style arrays (mx or numpy) strictly: every key consumed, none missing, shapes equal.
    dtype None: the device's compute dtype for the stored one; STORED: as stored (each op computes in
    the compute dtype all the same: the same numbers in less memory)."""
    dit_arrays, cond_arrays = split_dit_arrays({k: mx.array(v) for k, v in arrays.items()})
    storage = next(v.dtype for k, v in dit_arrays.items() if not k.endswith(FROZEN_FP32_SUFFIX))
    target = storage if dtype == STORED else dtype or compute_dtype(storage)

    def cast(key: str, value: mx.array) -> mx.array:
        if key.endswith(FROZEN_FP32_SUFFIX):
            return value.astype(mx.float32)
        return value.astype(target) if mx.issubdtype(value.dtype, mx.floating) else value

    dit = DiT(config)
    dit.load_weights([(k, cast(k, v)) for k, v in dit_arrays.items()], strict=True)
    conditioner.load_weights([(k, cast(k, v)) for k, v in cond_arrays.items()], strict=True)
    mx.eval(dit.parameters(), conditioner.parameters())  # read the file now, not lazily later
    dit.eval()
    conditioner.eval()
    return dit, conditioner


def load_dit(
    path: str | Path, config: ModelConfig | None = None, dtype: mx.Dtype | str | None = None
) -> tuple[DiT, Conditioner]:
    """A converted dit.npz -> (DiT, Conditioner), sizes from `config` or the model_config.json beside it.

    dtype None = the device's compute dtype for the stored dtype (fp32 on the CPU); STORED: as stored.
    """
    path = Path(path)
    if config is None:
        config_file = path.parent / MODEL_CONFIG_FILE
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{path}: no model_config.json beside it; pass a config "
                "(e.g. from sa3mlx.convert.model.dit_config_from_weights)"
            )
        config = ModelConfig.load(config_file)
    return build_dit(
        load_mlx_arrays(path, "DiT weights"), config.dit, Conditioner.from_config(config.conditioner), dtype
    )
