"""The SAME audio codec (SAME-S and SAME-L): encoder, decoder, SoftNorm bottleneck, loaders.

Encoder: patches [B, L, 512] -> zero pad -> `mapping` (1x1 conv) -> groups of `stride`
frames each followed by one learned token -> transformer blocks -> last token of every
group -> Linear(D -> latent) -> SoftNorm. Decoder: SoftNorm decode -> Linear(latent -> D)
-> zero pad (in D space) -> each latent followed by `stride` learned tokens -> blocks ->
drop the latent slots -> `mapping` (SAME-S: kernel 3) -> unpatch.

Attention pattern: SAME-S attends inside chunks of `chunk_size + chunk_size / stride`
tokens (positions restart in every chunk), its second half of blocks on chunks shifted by
half a chunk (the sequence extended by repeating its first and last half-chunk); SAME-L
uses exact band attention over the whole sequence. Public tensors use the official
layouts: audio [B, C, samples], latents [B, latent_dim, T]. Compute is fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from sa3mlx.models.config import AutoencoderConfig, ModelConfig, SameConfig
from sa3mlx.models.patching import patchify, unpatchify
from sa3mlx.models.same_layers import SameBlock
from sa3mlx.runtime.layout import MODEL_CONFIG_FILE

NOISE_REGULARIZE_EVAL = 1e-3  # official SoftNorm decode noise scale in eval mode


class Mapping(nn.Module):
    """Weight-norm-fused Conv1d with 'same' padding; weight in MLX layout (out, k, in)."""

    def __init__(self, cin: int, cout: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((cout, kernel, cin))
        self.bias = mx.zeros((cout,))

    def __call__(self, x: mx.array) -> mx.array:
        cout, kernel, _ = self.weight.shape
        if kernel > 1:  # unfold the taps into features: one matmul instead of a conv
            left = (kernel - 1) // 2
            length = x.shape[1]
            padded = mx.pad(x, [(0, 0), (left, kernel - 1 - left), (0, 0)])
            x = mx.concatenate([padded[:, i : i + length] for i in range(kernel)], axis=-1)
        return mx.addmm(self.bias, x, self.weight.reshape(cout, -1).T)


def pad_sequence(x: mx.array, modulo: int) -> mx.array:
    """Zero pad axis 1 of [B, N, F] to a multiple of `modulo`."""
    pad = -x.shape[1] % modulo
    return mx.pad(x, [(0, 0), (0, pad), (0, 0)]) if pad else x


class ResamplingBlock(nn.Module):
    """One `TransformerResamplingBlock` (encoder: 16 frames -> 1 latent; decoder: the reverse)."""

    def __init__(self, cfg: SameConfig, role: str, mask_noise: float = 0.0):
        super().__init__()
        D = cfg.width
        cin, cout = (cfg.io_channels, D) if role == "encoder" else (D, cfg.io_channels)
        self.mapping = Mapping(cin, cout, cfg.mapping_kernel)
        self.new_tokens = mx.zeros((1, 1, D))
        self.transformers = [
            SameBlock(D, cfg.dim_heads, cfg.ff_inner, cfg.depth - i < cfg.sinusoidal_blocks, cfg.differential)
            for i in range(cfg.depth)
        ]
        self.cfg, self.role, self.mask_noise = cfg, role, mask_noise

    @property
    def banded(self) -> bool:
        return self.cfg.sliding_window is not None

    @property
    def pad_modulo(self) -> int:
        """Encoder: patches; decoder: latents."""
        cfg = self.cfg
        if self.role == "encoder":
            return cfg.stride if self.banded else cfg.chunk_size
        return 1 if self.banded else cfg.chunk_size // cfg.stride

    def _tokens(self, shape: tuple[int, ...]) -> mx.array:
        tokens = mx.broadcast_to(self.new_tokens[:, None], shape)
        if self.mask_noise > 0:
            tokens = tokens + mx.random.normal(shape) * self.mask_noise
        return tokens

    def encode(self, patches: mx.array) -> mx.array:
        """[B, L, io] -> [B, n, D], n = ceil(L / pad_modulo) * pad_modulo / stride."""
        x = self.mapping(pad_sequence(patches, self.pad_modulo))
        B, L, D = x.shape
        s = self.cfg.stride
        x = x.reshape(B, L // s, s, D)
        x = mx.concatenate([x, self._tokens((B, L // s, 1, D))], axis=2)
        x = self.run_blocks(x.reshape(B, -1, D))
        return x.reshape(B, L // s, s + 1, D)[:, :, -1]

    def decode(self, x: mx.array) -> mx.array:
        """[B, T, D] -> [B, T' * stride, io], T' = T padded to pad_modulo."""
        x = pad_sequence(x, self.pad_modulo)
        B, T, D = x.shape
        s = self.cfg.stride
        x = mx.concatenate([x[:, :, None], self._tokens((B, T, s, D))], axis=2)
        x = self.run_blocks(x.reshape(B, -1, D))
        return self.mapping(x.reshape(B, T, s + 1, D)[:, :, 1:].reshape(B, T * s, D))

    def run_blocks(self, x: mx.array) -> mx.array:
        cfg, blocks = self.cfg, self.transformers
        group = cfg.stride + 1
        if self.banded:
            band = (cfg.sliding_window[0] * group, cfg.sliding_window[1] * group)
            for block in blocks:
                x = block(x, band)
            return x
        size = cfg.chunk_size + cfg.chunk_size // cfg.stride
        if not cfg.chunk_midpoint_shift:
            return _in_chunks(x, blocks, size)
        split, shift = cfg.depth // 2, size // 2
        x = _in_chunks(x, blocks[:split], size)
        x = mx.concatenate([x[:, :shift], x, x[:, -shift:]], axis=1)
        return _in_chunks(x, blocks[split:], size)[:, shift:-shift]


def _in_chunks(x: mx.array, blocks: list, size: int) -> mx.array:
    """Run blocks with attention inside non-overlapping chunks of `size` tokens."""
    B, N, D = x.shape
    x = x.reshape(B * (N // size), size, D)
    for block in blocks:
        x = block(x)
    return x.reshape(B, N, D)


class SoftNorm(nn.Module):
    """SoftNorm bottleneck parameters; the encoder half owns scale and bias."""

    def __init__(self, latent_dim: int, encode: bool):
        super().__init__()
        if encode:
            self.scaling_factor = mx.ones((1, latent_dim, 1))
            self.bias = mx.zeros((1, latent_dim, 1))
        self.running_std = mx.ones((1,))

    def encode(self, x: mx.array) -> mx.array:
        return (x * self.scaling_factor + self.bias) / self.running_std

    def decode(self, x: mx.array, noise: bool = False) -> mx.array:
        x = x * self.running_std
        if noise:
            x = x + mx.random.normal(x.shape) * self.running_std * NOISE_REGULARIZE_EVAL
        return x


class SameEncoder(nn.Module):
    """Audio [B, C, samples] -> latents [B, latent_dim, T] (the official unchunked `encode_audio`)."""

    def __init__(self, cfg: AutoencoderConfig, mask_noise: float = 0.0):
        super().__init__()
        enc = cfg.encoder
        self.layers = [
            ResamplingBlock(enc, "encoder", mask_noise),
            nn.Identity(),
            nn.Linear(enc.width, cfg.latent_dim),
            nn.Identity(),
        ]
        self.bottleneck = SoftNorm(cfg.latent_dim, encode=True)
        self.cfg = cfg

    @property
    def samples_per_latent(self) -> int:
        return self.cfg.downsampling_ratio

    @property
    def latent_modulo(self) -> int:
        """Latent counts are multiples of this (SAME-S: 2, SAME-L: 1)."""
        return self.layers[0].pad_modulo * self.cfg.patch_size // self.samples_per_latent

    def latent_count(self, samples: int) -> int:
        per, m = self.samples_per_latent, self.latent_modulo
        return -(-samples // (per * m)) * m

    def features(self, audio: mx.array) -> mx.array:
        """Encoder output before the bottleneck, [B, latent_dim, T]."""
        x = self.layers[0].encode(patchify(audio.astype(mx.float32), self.cfg.patch_size))
        return self.layers[2](x).transpose(0, 2, 1)

    def __call__(self, audio: mx.array) -> mx.array:
        return self.bottleneck.encode(self.features(audio))


class SameDecoder(nn.Module):
    """Latents [B, latent_dim, T] -> audio [B, C, T' * 4096] (official `decode_audio`; SAME-S
    pads an odd T to T' = T + 1 and returns its samples too)."""

    def __init__(self, cfg: AutoencoderConfig, mask_noise: float = 0.0, noise_regularize: bool = False):
        super().__init__()
        dec = cfg.decoder
        self.layers = [
            nn.Identity(),
            nn.Linear(cfg.latent_dim, dec.width),
            nn.Identity(),
            ResamplingBlock(dec, "decoder", mask_noise),
        ]
        self.bottleneck = SoftNorm(cfg.latent_dim, encode=False)
        self.cfg, self.noise_regularize = cfg, noise_regularize

    @property
    def samples_per_latent(self) -> int:
        return self.cfg.downsampling_ratio

    @property
    def latent_modulo(self) -> int:
        return self.layers[3].pad_modulo

    def __call__(self, latents: mx.array) -> mx.array:
        x = self.bottleneck.decode(latents.astype(mx.float32), self.noise_regularize)
        x = self.layers[1](x.transpose(0, 2, 1))
        return unpatchify(self.layers[3].decode(x), self.cfg.audio_channels)


def autoencoder_config(folder: str | Path) -> AutoencoderConfig:
    """The codec config from a folder's model_config.json (an SA3 model or a standalone SAME repo)."""
    path = Path(folder) / MODEL_CONFIG_FILE
    data = json.loads(path.read_text())
    if data.get("model_type") == "autoencoder":
        return AutoencoderConfig.from_standalone(data)
    return ModelConfig.from_dict(data, str(path)).autoencoder


def load_arrays(module: nn.Module, arrays: dict, source: str) -> nn.Module:
    """Strict load: every key consumed, none missing, shapes equal; weights cast to fp32."""
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(set(arrays) - set(expected))
    misshaped = sorted(k for k in set(expected) & set(arrays) if tuple(arrays[k].shape) != expected[k].shape)
    if missing or unexpected or misshaped:
        raise ValueError(
            f"{source}: weights do not match {type(module).__name__}: "
            f"missing {missing[:20]}, unexpected {unexpected[:20]}, mis-shaped {misshaped[:20]}"
        )
    module.load_weights([(k, mx.array(v).astype(mx.float32)) for k, v in arrays.items()], strict=True)
    mx.eval(module.parameters())
    return module


def same_encoder_from_arrays(arrays: dict, cfg: AutoencoderConfig, source: str = "arrays", **noise) -> SameEncoder:
    return load_arrays(SameEncoder(cfg, **noise), arrays, source)


def same_decoder_from_arrays(arrays: dict, cfg: AutoencoderConfig, source: str = "arrays", **noise) -> SameDecoder:
    return load_arrays(SameDecoder(cfg, **noise), arrays, source)


def load_same_encoder(path: str | Path, config: AutoencoderConfig | None = None, **noise) -> SameEncoder:
    """`same_encoder.npz` (config from the model_config.json next to it unless given)."""
    path = Path(path)
    cfg = config or autoencoder_config(path.parent)
    return same_encoder_from_arrays(dict(mx.load(str(path))), cfg, str(path), **noise)


def load_same_decoder(path: str | Path, config: AutoencoderConfig | None = None, **noise) -> SameDecoder:
    """`same_decoder.npz`; noise flags (mask_noise, noise_regularize) are off unless given."""
    path = Path(path)
    cfg = config or autoencoder_config(path.parent)
    return same_decoder_from_arrays(dict(mx.load(str(path))), cfg, str(path), **noise)
