"""Chunked SAME encode and decode for long audio, with bounded memory.

Two modes, chunk sizes and overlaps in latents (1 latent = 4096 samples):

* torch-compatible (`encode_chunked_torch`, `decode_chunked_torch`): the official
  `AudioAutoencoder.encode_audio/decode_audio(chunked=True)`. Chunks start every
  `chunk - overlap` latents, the last one anchored to the end (for encoding at an
  arbitrary sample offset); encoding yields floor(samples / 4096) latents.
* production (`encode_long`, `decode_long`): the audio is padded to the codec's
  modulo first and chunk starts stay on its latent grid, so the latent count equals
  the unchunked count and every chunk sees the same attention chunking as the whole
  input would. Encoding also returns the validity mask ceil(valid_samples / 4096).

Both keep, of every chunk, `[left, right)` with `left = 0` for the first chunk else
`overlap // 2`, `right = chunk` for the last else `chunk - overlap // 2`, pasted in order.
Inputs may be numpy arrays: only one chunk at a time then lives in MLX memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from sa3mlx.models.same import SameDecoder, SameEncoder


def chunk_starts(total: int, chunk: int, hop: int) -> list[int]:
    """`range(0, total - chunk + 1, hop)` plus a last chunk anchored at `total - chunk`."""
    starts = list(range(0, total - chunk + 1, hop))
    if starts[-1] != total - chunk:
        starts.append(total - chunk)
    return starts


def _stitch(run, starts: list[int], places: list[int], out: np.ndarray, chunk: int, half: int) -> np.ndarray:
    """Run the chunks one at a time; paste each one's kept span [left, right) at its place in `out`.

    `run(start)` is the chunk's output; `places`, `chunk` and `half` are in output units.
    """
    for i, (start, place) in enumerate(zip(starts, places)):
        left = 0 if i == 0 else half
        right = chunk if i == len(starts) - 1 else chunk - half
        piece = run(start)
        mx.eval(piece)
        out[..., place + left : place + right] = np.asarray(piece[..., left:right])
    return out


def _places(starts: list[int], scale: int, last: int) -> list[int]:
    """Paste positions: start * scale, except the last chunk's at `last`."""
    return [s * scale for s in starts[:-1]] + [last]


def encode_chunked_torch(encoder: SameEncoder, audio, chunk_size: int, overlap: int) -> mx.array:
    """The official chunked `encode_audio`: floor(samples / 4096) latents."""
    per = encoder.samples_per_latent
    samples = audio.shape[-1]
    if samples < chunk_size * per:
        return encoder(mx.array(audio))
    span = chunk_size * per
    starts = chunk_starts(samples, span, (chunk_size - overlap) * per)
    total = samples // per
    out = np.zeros((audio.shape[0], encoder.cfg.latent_dim, total), np.float32)

    def run(start: int) -> mx.array:
        return encoder(mx.array(audio[..., start : start + span]))

    places = _places([s // per for s in starts], 1, total - chunk_size)
    return mx.array(_stitch(run, starts, places, out, chunk_size, overlap // 2))


def decode_chunked_torch(decoder: SameDecoder, latents, chunk_size: int, overlap: int) -> mx.array:
    """The official chunked `decode_audio`: total_latents * 4096 samples."""
    total = latents.shape[-1]
    if total < chunk_size:
        return decoder(mx.array(latents))
    per = decoder.samples_per_latent
    starts = chunk_starts(total, chunk_size, chunk_size - overlap)
    out = np.zeros((latents.shape[0], decoder.cfg.audio_channels, total * per), np.float32)

    def run(start: int) -> mx.array:
        return decoder(mx.array(latents[..., start : start + chunk_size]))

    places = _places(starts, per, (total - chunk_size) * per)
    return mx.array(_stitch(run, starts, places, out, chunk_size * per, (overlap // 2) * per))


def _check_grid(chunk: int, overlap: int, modulo: int) -> None:
    if not 0 <= overlap < chunk:
        raise ValueError(f"chunk overlap {overlap} must be in [0, chunk={chunk})")
    if chunk % modulo or overlap % modulo:
        raise ValueError(
            f"chunk ({chunk}) and overlap ({overlap}) must be multiples of the codec's latent modulo {modulo}"
        )


def latent_mask(valid_samples: int | Sequence[int], count: int, samples_per_latent: int) -> np.ndarray:
    """[B, count] bool: True for the first ceil(valid / samples_per_latent) latents of each item."""
    valid = np.atleast_1d(np.asarray(valid_samples, dtype=np.int64))
    lengths = -(-valid // samples_per_latent)
    return np.arange(count)[None, :] < lengths[:, None]


def encode_long(
    encoder: SameEncoder, audio, chunk: int = 128, overlap: int = 32, valid_samples: int | Sequence[int] | None = None
) -> tuple[mx.array, np.ndarray]:
    """Production encode: (latents [B, latent_dim, n], mask [B, n]), n = the unchunked count."""
    per, modulo = encoder.samples_per_latent, encoder.latent_modulo
    _check_grid(chunk, overlap, modulo)
    samples = audio.shape[-1]
    total = encoder.latent_count(samples)
    valid = [samples] * audio.shape[0] if valid_samples is None else valid_samples
    mask = np.broadcast_to(latent_mask(valid, total, per), (audio.shape[0], total)).copy()
    if total <= chunk:
        return encoder(mx.array(audio)), mask
    starts = chunk_starts(total, chunk, chunk - overlap)
    out = np.zeros((audio.shape[0], encoder.cfg.latent_dim, total), np.float32)

    def run(start: int) -> mx.array:  # a short last slice is zero padded: as if padded first
        return encoder(mx.array(audio[..., start * per : (start + chunk) * per]))

    places = _places(starts, 1, total - chunk)
    return mx.array(_stitch(run, starts, places, out, chunk, overlap // 2)), mask


def decode_long(decoder: SameDecoder, latents, chunk: int = 128, overlap: int = 32) -> mx.array:
    """Production decode: exactly T * 4096 samples for T latents."""
    per, modulo = decoder.samples_per_latent, decoder.latent_modulo
    _check_grid(chunk, overlap, modulo)
    count = latents.shape[-1]
    total = -(-count // modulo) * modulo  # the decoder pads to this in D space
    if total <= chunk:
        return decoder(mx.array(latents))[..., : count * per]
    starts = chunk_starts(total, chunk, chunk - overlap)
    out = np.zeros((latents.shape[0], decoder.cfg.audio_channels, total * per), np.float32)

    def run(start: int) -> mx.array:  # a short last chunk is padded in D space, as unchunked
        return decoder(mx.array(latents[..., start : min(start + chunk, count)]))

    places = _places(starts, per, (total - chunk) * per)
    audio = _stitch(run, starts, places, out, chunk * per, (overlap // 2) * per)
    return mx.array(audio[..., : count * per])
