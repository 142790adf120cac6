"""The DiT forward, the LoRA training step and bench/memory.py's small case on the default device
(CPU, Metal or CUDA, whichever this MLX build runs on), under the device policy of
sa3mlx/runtime/precision.py: CPU fp32; GPU base in fp16 (the converted storage dtype) with fp32
adapters, gradients and optimizer state.

    python bench/device.py [--crop 1300] [--depth 20] [--repeats 3] [--no-memory]

Small-music dims, random weights, batch 1. Prints the device line, forward ms and train s/step
(min/median/max), peak memory, then (unless --no-memory) the small-music case of
bench/memory.py at `--crop` with checkpointing, in its own process. Last line: RESULT {json}.
"""

from __future__ import annotations

import sa3mlx  # noqa: F401  (first: sets MLX's BLAS up before mlx is imported)

# isort: split

import argparse
import dataclasses
import json
import statistics

import mlx.core as mx
from blas import repeat_seconds  # bench/blas.py: the shared timing
from dit import PROMPT_TOKENS, SIZES  # bench/dit.py
from memory import spawn  # bench/memory.py
from mlx.utils import tree_map
from train import random_step  # bench/train.py

from sa3mlx.models.dit import DiT
from sa3mlx.runtime.precision import compute_dtype, configure_device

STORAGE = mx.float16  # convert.dit_dtype's default


def spread(times: list[float]) -> list[float]:
    return [min(times), statistics.median(times), max(times)]


def forward(cfg, crop: int, dtype, repeats: int) -> list[float]:
    mx.random.seed(0)
    dit = DiT(cfg)
    dit.update(tree_map(lambda p: p.astype(dtype), dit.parameters()))
    x = mx.random.normal((1, cfg.io_channels, crop))
    cross = mx.random.normal((1, PROMPT_TOKENS, cfg.cond_token_dim))
    glob = mx.random.normal((1, cfg.global_cond_dim))
    local = mx.zeros((1, cfg.local_add_cond_dim, crop))
    mx.eval(dit.parameters(), x, cross, glob, local)
    return repeat_seconds(lambda: mx.eval(dit(x, mx.array([0.7]), cross, glob, local)), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crop", type=int, default=1300)
    parser.add_argument("--depth", type=int, default=SIZES["small"].depth)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip bench/memory.py's small case")
    args = parser.parse_args()
    line = configure_device()
    dtype = compute_dtype(STORAGE)
    print(f"MLX {mx.__version__}; {line}; base computes in {dtype}")
    cfg = dataclasses.replace(SIZES["small"], depth=args.depth)
    fwd = forward(cfg, args.crop, dtype, args.repeats)
    print(f"small-music/d{cfg.depth} forward, crop {args.crop}: {1e3 * statistics.median(fwd):.0f} ms")
    mx.reset_peak_memory()
    core, batch, _ = random_step(cfg, args.crop, 16, False, True, grad_checkpoint=True, dtype=dtype)
    step = repeat_seconds(lambda: core.run([batch]), args.repeats)
    peak = mx.get_peak_memory() / 1e9
    median = statistics.median(step)
    print(f"train step (dora-rows r16, checkpointed), crop {args.crop}: {median:.2f} s, peak {peak:.2f} GB")
    result = {
        "device": line,
        "compute_dtype": str(dtype),
        "crop": args.crop,
        "depth": cfg.depth,
        "forward_ms": [round(1e3 * t, 1) for t in spread(fwd)],
        "train_step_s": [round(t, 3) for t in spread(step)],
        "train_peak_gb": round(peak, 3),
    }
    if not args.no_memory:
        row = spawn(f"small:{cfg.depth}:{args.crop}:on", args.repeats)
        print(f"bench/memory.py small case: peak {row['peak_gb']:.2f} GB, s/step {row['step_s']}")
        result.update(memory_peak_gb=round(row["peak_gb"], 3), memory_s_per_step=[round(s, 3) for s in row["step_s"]])
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
