"""`encode` stage throughput at the real SAME-S dims (random weights) on one long file: first run vs cached run.

    python bench/encode.py [--seconds 120] [--repeats 3]

Each repeat runs the stage's `encode_dir` twice on a fresh cache: the first run hashes the
file, loads the encoder and encodes (production chunking above 30 s); the second finds the
latents in the content cache and only hashes, copies and writes the sidecar. Speeds are
seconds of audio per wall second; medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from same import SAME_S, SAMPLE_RATE, randomize  # bench/same.py builds the SAME-S codec

from sa3mlx.audio.write import write_float_wav
from sa3mlx.data.encode import Codec, EncodeOptions, encode_dir
from sa3mlx.models.config import AutoencoderConfig
from sa3mlx.models.same import SameEncoder


def write_codec(folder: Path) -> AutoencoderConfig:
    """A converted-codec folder (same_encoder.npz + standalone model_config.json) with random weights."""
    cfg = AutoencoderConfig.from_dict(SAME_S)
    mx.random.seed(0)
    encoder = SameEncoder(cfg)
    randomize(encoder)
    folder.mkdir(parents=True)
    mx.savez(str(folder / "same_encoder.npz"), **dict(tree_flatten(encoder.parameters())))
    config = {"model_type": "autoencoder", "sample_rate": SAMPLE_RATE, "audio_channels": 2, "model": SAME_S}
    (folder / "model_config.json").write_text(json.dumps(config))
    return cfg


def timed_run(root: Path, codec_folder: Path, cache: Path) -> tuple[float, str]:
    start = time.perf_counter()
    summary = encode_dir(
        root / "normalized",
        root / "latents",
        cache,
        Codec.open(codec_folder),
        EncodeOptions(),
        "same-s-random",
        log=lambda line: None,
    )
    return time.perf_counter() - start, summary.line()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = write_codec(root / "codec")
        audio = 0.1 * np.random.default_rng(0).standard_normal((int(args.seconds * SAMPLE_RATE), 2))
        write_float_wav(root / "normalized" / "clip.wav", audio.astype(np.float32), SAMPLE_RATE)
        (root / "normalized" / "clip.json").write_text('{"prompt": "noise"}')
        print(
            f"SAME-S dims: D={cfg.encoder.width}, heads={cfg.encoder.width // cfg.encoder.dim_heads}, "
            f"{cfg.encoder.depth} blocks, fp32; one {args.seconds:g} s file; device {mx.default_device()}"
        )
        first, cached = [], []
        for i in range(args.repeats):
            cache = root / f"cache{i}"
            wall, line = timed_run(root, root / "codec", cache)
            first.append(wall)
            wall, again = timed_run(root, root / "codec", cache)
            cached.append(wall)
            print(f"  repeat {i + 1}: first {first[-1]:.2f} s ({line}); cached {cached[-1]:.3f} s ({again})")
            shutil.rmtree(cache)
        f, c = statistics.median(first), statistics.median(cached)
        print(f"{'run':<7} {'median wall s':>14} {'audio s / wall s':>17}")
        print(f"{'first':<7} {f:14.3f} {args.seconds / f:17.1f}")
        print(f"{'cached':<7} {c:14.3f} {args.seconds / c:17.1f}")
        print(f"cached run is {f / c:.0f}x faster than the first")


if __name__ == "__main__":
    main()
