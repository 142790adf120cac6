"""Time of the `svd` stage at the small-music DiT sizes (random weights), measured in one run.

    python bench/svd.py [--depth 20] [--max-rank 64] [--precision stored]

Random fp16 dit.npz arrays with the official small-music shapes (E=1024, depth 20 by default)
go through the stage's library call twice; prints the wall time per run and per layer, the
share of the largest layer class, and whether the two files have identical bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from dit import SIZES  # bench/dit.py: the official small-music / medium DiT configs

import sa3mlx  # noqa: F401  (BLAS set-up before mlx)
from sa3mlx.convert.dit import mlx_dit_shapes
from sa3mlx.lora.bases import bases_metadata, write_svd_file
from sa3mlx.lora.svd import canonical_svd

COND_DIM = 768


def random_model(depth: int) -> tuple[dict[str, np.ndarray], object]:
    """fp16 dit.npz arrays with the small-music shapes (the official files are fp16)."""
    cfg = dataclasses.replace(SIZES["small"], depth=depth)
    rng = np.random.default_rng(0)
    arrays = {
        key: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        for key, shape in mlx_dit_shapes(cfg, COND_DIM).items()
    }
    return arrays, cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--max-rank", type=int, default=64)
    parser.add_argument("--precision", default="stored")
    args = parser.parse_args()
    arrays, cfg = random_model(args.depth)
    times, files = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(2):
            start = time.perf_counter()
            path = write_svd_file(
                Path(tmp) / f"run{run}", arrays, cfg, COND_DIM, args.max_rank, args.precision, {"source": "random"}
            )
            times.append(time.perf_counter() - start)
            files.append(path.read_bytes())
        layers = bases_metadata(path)["layers"]
    E, F = cfg.embed_dim, cfg.ff_inner
    rng = np.random.default_rng(1)
    qkv = _time(lambda: canonical_svd(rng.standard_normal((3 * E, E), dtype=np.float32)))
    ff = _time(lambda: canonical_svd(rng.standard_normal((2 * F, E), dtype=np.float32)))
    total = statistics.median(times)
    print(
        f"svd stage, small-music dims (E={E}), depth {args.depth}: {layers} layers, median {total:.1f} s per run "
        f"({1000 * total / layers:.0f} ms per layer); identical bytes across the two runs: {files[0] == files[1]}"
    )
    print(
        f"  one to_qkv SVD ({3 * E}x{E}) {qkv:.2f} s, one ff.0.proj SVD ({2 * F}x{E}) {ff:.2f} s: "
        f"ff.0.proj layers are {args.depth * ff / total:.0%} of a run"
    )


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
