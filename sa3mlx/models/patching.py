"""The SAME patch transform: stereo audio <-> a sequence of 512-feature patches.

Audio [B, C, T] is zero padded to a multiple of `patch` samples and cut into
frames; frame l holds features `c * patch + h` = sample `l * patch + h` of
channel c (channel-major, the official `b c (l h) -> b (c h) l`). Patches are
kept channels-last, [B, L, C * patch], the MLX conv layout.
"""

from __future__ import annotations

import mlx.core as mx


def patch_count(samples: int, patch: int) -> int:
    return -(-samples // patch)


def patchify(audio: mx.array, patch: int) -> mx.array:
    """[B, C, T] -> [B, ceil(T / patch), C * patch], zero padded at the end."""
    B, C, T = audio.shape
    frames = patch_count(T, patch)
    pad = frames * patch - T
    if pad:
        audio = mx.pad(audio, [(0, 0), (0, 0), (0, pad)])
    x = audio.reshape(B, C, frames, patch)
    return x.transpose(0, 2, 1, 3).reshape(B, frames, C * patch)


def unpatchify(patches: mx.array, channels: int) -> mx.array:
    """[B, L, C * patch] -> [B, C, L * patch]: the exact inverse of `patchify` (padding kept)."""
    B, L, F = patches.shape
    patch = F // channels
    x = patches.reshape(B, L, channels, patch).transpose(0, 2, 1, 3)
    return x.reshape(B, channels, L * patch)
