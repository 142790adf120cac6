"""SAME-S codec speed and memory at the real dims (D=768, 12 heads of 64, 6+6 blocks), random weights.

    python bench/same.py [--seconds 30 120] [--chunk 128] [--overlap 32] [--unchunked]

For each length, the production chunked encode (`encode_long`) and decode (`decode_long`)
of 44.1 kHz stereo audio: speed as seconds of audio per wall second (x real time) and MLX
peak memory (reset before every run; the input audio lives in numpy, so the peak is the
weights plus one chunk's working set plus MLX's copy of the output). `--unchunked` adds a
one-pass encode of each length for comparison.
"""

from __future__ import annotations

import argparse
import time

import sa3mlx  # noqa: F401  (BLAS set-up before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from mlx.utils import tree_map_with_path

from sa3mlx.models.config import AutoencoderConfig
from sa3mlx.models.same import SameDecoder, SameEncoder
from sa3mlx.models.same_chunked import decode_long, encode_long

SAMPLE_RATE = 44100
MB = 1024 * 1024
# the SAME-S codec fields of a small SA3 model_config.json (reference sa3.md section 4.2)
HALF = {
    "channels": 128,
    "c_mults": [6],
    "strides": [16],
    "latent_dim": 256,
    "transformer_depths": [6],
    "differential": True,
    "dyt": True,
    "dim_heads": 64,
    "variable_stride": True,
    "chunk_size": 32,
    "chunk_midpoint_shift": True,
}
SAME_S = {
    "encoder": {"type": "same", "config": {"in_channels": 512, **HALF}},
    "decoder": {"type": "same", "config": {"out_channels": 512, "conv_mapping": True, **HALF}},
    "bottleneck": {"type": "softnorm", "config": {"dim": 256}},
    "pretransform": {"type": "patched", "config": {"patch_size": 256, "channels": 2}},
    "latent_dim": 256,
    "downsampling_ratio": 4096,
    "io_channels": 2,
}


def randomize(model) -> None:
    """Small random weights; DyT alphas at their init (4), RoPE buffers kept."""

    def draw(path: str, p: mx.array) -> mx.array:
        if path.endswith("inv_freq"):
            return p
        if path.endswith("alpha"):
            return mx.full(p.shape, 4.0)
        return mx.random.normal(p.shape) * 0.02

    model.update(tree_map_with_path(draw, model.parameters()))
    mx.eval(model.parameters())


def measure(fn) -> tuple[float, float, object]:
    """(wall seconds, MLX peak MB, result) of one call."""
    mx.reset_peak_memory()
    start = time.perf_counter()
    result = fn()
    mx.eval(result[0] if isinstance(result, tuple) else result)
    return time.perf_counter() - start, mx.get_peak_memory() / MB, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[30.0, 120.0])
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--overlap", type=int, default=32)
    parser.add_argument("--unchunked", action="store_true")
    args = parser.parse_args()

    cfg = AutoencoderConfig.from_dict(SAME_S)
    mx.random.seed(0)
    encoder, decoder = SameEncoder(cfg), SameDecoder(cfg)
    randomize(encoder)
    randomize(decoder)
    weights_mb = mx.get_active_memory() / MB
    print(
        f"SAME-S dims: D={cfg.encoder.width}, heads={cfg.encoder.width // cfg.encoder.dim_heads}, "
        f"blocks {cfg.encoder.depth}+{cfg.decoder.depth}, fp32 weights {weights_mb:.0f} MB; "
        f"chunk {args.chunk} latents, overlap {args.overlap}; device {mx.default_device()}"
    )
    rng = np.random.default_rng(0)
    warm = (0.1 * rng.standard_normal((1, 2, args.chunk * cfg.downsampling_ratio))).astype(np.float32)
    mx.eval(decoder(encoder(mx.array(warm))))

    print(f"{'audio':>7} {'mode':<16} {'wall s':>8} {'x realtime':>11} {'peak MB':>9} {'output MB':>10}")
    for seconds in args.seconds:
        audio = (0.1 * rng.standard_normal((1, 2, int(seconds * SAMPLE_RATE)))).astype(np.float32)
        rows = []
        wall, peak, (latents, _) = measure(lambda: encode_long(encoder, audio, args.chunk, args.overlap))
        rows.append(("encode chunked", wall, peak, latents.nbytes))
        wall, peak, decoded = measure(lambda: decode_long(decoder, np.array(latents), args.chunk, args.overlap))
        rows.append(("decode chunked", wall, peak, decoded.nbytes))
        if args.unchunked:
            wall, peak, whole = measure(lambda: encoder(mx.array(audio)))
            rows.append(("encode 1 pass", wall, peak, whole.nbytes))
        for mode, wall, peak, nbytes in rows:
            print(f"{seconds:6.0f}s {mode:<16} {wall:8.2f} {seconds / wall:11.2f} {peak:9.0f} {nbytes / MB:10.2f}")


if __name__ == "__main__":
    main()
