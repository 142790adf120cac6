"""Full LoRA training step (loss, adapter gradients, clipping, AdamW update) vs this machine's
fp32 GEMM peak, measured in one run; plus steps/s of the tiny default model.

    python bench/train.py [--depth N] [--crop 256] [--rank 16] [--repeats 3] [--gemm-n 2048]
                          [--materialize off|on|both] [--no-compile] [--tiny-batch 8] [--tiny-crop 128]

Small-music DiT dims with random weights, dora-rows adapters on the default targets (the
dashboard excludes; seconds embedder included), batch 1, `crop` latent frames, the
`underfit-dashboard` objective (random inpainting masks, clip 1.0). Achieved GFLOP/s counts the
matmul FLOPs a LoRA step needs: the forward plus the activation-gradient pass (2·linear +
3·attention, as `bench/dit.py`); adapter maths is not counted. Target on CPU: >= 60 % of GEMM.
Step times as min / median / max of the repeats, GFLOP/s from the median; last line RESULT {json}
with `step_s_median`, `step_s_min`, `step_s_max`, `step_pct_gemm` (the unmaterialised form; with
--materialize both the materialised one under `materialized_*`). SA3MLX_FAST_KERNELS=0 times MLX's
own CPU kernels instead. --tiny-steps 0 skips the tiny-default rate.
The tiny default is `models/tiny-base` converted into a temporary folder, trained through
`TrainingSession` with the default preset on synthetic latents.
"""

from __future__ import annotations

import sa3mlx  # noqa: F401  (first: sets MLX's BLAS up before mlx is imported)

# isort: split

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

# isort: split
import mlx.core as mx
import numpy as np
from blas import mlx_gemm, spread  # bench/blas.py: the GEMM measurement, shared
from dit import PROMPT_TOKENS, SIZES, matmul_flops  # bench/dit.py: the small-music config and FLOP count
from mlx.utils import tree_map_with_path

from sa3mlx.convert.model import convert_source
from sa3mlx.lora.inject import inject_adapters
from sa3mlx.models.conditioning import FROZEN_FP32_SUFFIX, Conditioner
from sa3mlx.models.dit import DiT
from sa3mlx.runtime import kernels
from sa3mlx.train.objective import ObjectiveConfig, random_inpaint_masks
from sa3mlx.train.optim import AdamWConfig, make_adamw
from sa3mlx.train.presets import resolve
from sa3mlx.train.session import TrainingSession
from sa3mlx.train.step import StepCore

TARGET = 0.6  # issue 14: ~2.5x the official torch step on a 2-core x86 machine
ROOT = Path(__file__).resolve().parents[1]
PRESET = "underfit-dashboard"


def random_batch(cfg, crop: int, objective: ObjectiveConfig, rng: np.random.Generator) -> dict:
    C = cfg.io_channels
    padding = np.ones((1, crop), bool)
    tokens = PROMPT_TOKENS - 1  # the seconds token is appended by the conditioner
    arrays = {
        "x0": rng.standard_normal((1, C, crop), np.float32),
        "noise": rng.standard_normal((1, C, crop), np.float32),
        "t": np.array([0.7], np.float32),
        "prompt_hidden": rng.standard_normal((1, tokens, cfg.cond_token_dim), np.float32),
        "prompt_mask": np.ones((1, tokens), bool),
        "seconds": np.array([30.0], np.float32),
        "drop": np.zeros(1, bool),
        "padding_mask": padding,
    }
    if objective.inpainting:
        arrays["inpaint_mask"] = random_inpaint_masks(rng, padding, objective.inpaint_mask_probabilities, False)
    return {k: mx.array(v) for k, v in arrays.items()}


def random_step(
    cfg, crop: int, rank: int, materialize: bool, compile: bool, grad_checkpoint: bool = False, dtype=mx.float32
) -> tuple[StepCore, dict, int]:
    """(StepCore, batch, adapted layer count) of a random-weight DiT of `cfg` (base in `dtype`) with
    the preset's adapters."""
    train = resolve(PRESET, {"adapter": {"rank": rank}, "mask_padding_attention": True})  # as shipped SA3 configs
    mx.random.seed(0)
    dit, cond = DiT(cfg), Conditioner(cfg.cond_token_dim)
    cast = lambda path, p: p if path.endswith(FROZEN_FP32_SUFFIX) else p.astype(dtype)  # as build_dit loads
    dit.update(tree_map_with_path(cast, dit.parameters()))
    cond.update({k: mx.random.normal(v.shape) * 0.02 for k, v in cond.parameters().items()})
    layers = inject_adapters(dit, cond, train.adapter, key=mx.random.key(0), materialize=materialize, announce=False)
    dit.transformer.checkpoint_blocks = grad_checkpoint
    mx.eval(dit.parameters(), cond.parameters())
    objective = ObjectiveConfig.from_train_config(train)
    optimizer = make_adamw(AdamWConfig(train.lr, train.betas, train.eps, train.weight_decay))
    core = StepCore(dit, cond, layers, objective, optimizer, train.grad_clip, compile)
    return core, random_batch(cfg, crop, objective, np.random.default_rng(0)), len(layers)


def time_steps(core: StepCore, batch: dict, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first step, which compiles; seconds of each of `repeats` more)."""
    start = time.perf_counter()
    core.run([batch])
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        core.run([batch])
        times.append(time.perf_counter() - start)
    return first, times


def small_step(depth: int | None, crop: int, rank: int, materialize: bool, compile: bool, repeats: int) -> dict:
    cfg = SIZES["small"] if depth is None else dataclasses.replace(SIZES["small"], depth=depth)
    core, batch, layers = random_step(cfg, crop, rank, materialize, compile)
    mx.reset_peak_memory()
    first, times = time_steps(core, batch, repeats)
    linear, attention = matmul_flops(cfg, crop)
    step_s = spread(times)
    return {
        "depth": cfg.depth,
        "layers": layers,
        "first_s": first,
        "step_s": step_s,
        "gflops": (2 * linear + 3 * attention) / step_s["median"] / 1e9,
        "peak_gb": mx.get_peak_memory() / 1e9,
    }


def tiny_steps_per_second(batch_size: int, crop: int, steps: int, compile: bool) -> tuple[float, float]:
    """(steps/s after the first step, first-step seconds) of the tiny default through TrainingSession."""
    train = resolve(PRESET, {"batch_size": batch_size, "latent_crop_length": crop})
    with tempfile.TemporaryDirectory() as tmp:
        convert_source(ROOT / "models" / "tiny-base", tmp)
        session = TrainingSession.build(tmp, train, seed=0, compile=compile)
        rng = np.random.default_rng(0)
        batch = {
            "latents": rng.standard_normal((batch_size, 16, crop), np.float32),
            "padding_mask": np.ones((batch_size, crop), bool),
            "seconds_total": np.full(batch_size, 30.0),
            "prompts": [f"prompt {i % 3}" for i in range(batch_size)],
        }
        start = time.perf_counter()
        session.step(batch, np.random.default_rng([0, 0]))
        first = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(steps):
            session.step(batch, np.random.default_rng([0, i + 1]))
        return steps / (time.perf_counter() - start), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, help="override the depth (fewer blocks, same per-block shapes)")
    parser.add_argument("--crop", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemm-n", type=int, default=2048)
    parser.add_argument(
        "--materialize",
        choices=("both", "on", "off"),
        default="off",
        help="adapters as built effective weights (on) or low-rank branch + gains (off)",
    )
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tiny-batch", type=int, default=None, help="default: the preset's batch size")
    parser.add_argument("--tiny-crop", type=int, default=128)
    parser.add_argument("--tiny-steps", type=int, default=10)
    args = parser.parse_args()
    compile = not args.no_compile

    gemm = mlx_gemm(args.gemm_n, 5)
    print(f"MLX {mx.__version__} on {mx.default_device()}; fp32 GEMM n={args.gemm_n}: {gemm:.1f} GFLOP/s")
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.materialize]
    result = {}
    for materialize in modes:
        row = small_step(args.depth, args.crop, args.rank, materialize, compile, args.repeats)
        mx.clear_cache()
        gemm = max(gemm, mlx_gemm(args.gemm_n, 5))  # again after the model: the highest so far is the reference
        ratio = row["gflops"] / gemm
        step = row["step_s"]
        print(
            f"small-music/d{row['depth']} crop {args.crop} dora-rows r{args.rank} ({row['layers']} layers), "
            f"materialize={'on' if materialize else 'off'}, {'compiled' if compile else 'eager'}: "
            f"{step['min']:.2f} / {step['median']:.2f} / {step['max']:.2f} s/step (min/median/max of {args.repeats}; "
            f"first {row['first_s']:.1f} s), {row['gflops']:.1f} GFLOP/s = {ratio:.0%} of GEMM {gemm:.1f} "
            f"(target >= {TARGET:.0%}) {'ok' if ratio >= TARGET else 'BELOW TARGET'}; peak {row['peak_gb']:.2f} GB"
        )
        prefix = "step" if materialize == modes[-1] else "materialized_step"
        result.update({f"{prefix}_s_{k}": v for k, v in step.items()})
        result.update({f"{prefix}_pct_gemm": 100 * ratio, f"{prefix}_peak_gb": row["peak_gb"]})
    result.update(gemm_gflops=gemm, depth=row["depth"], crop=args.crop, kernels=os.environ.get(kernels.SWITCH, "1"))
    if args.tiny_steps:
        batch = args.tiny_batch or resolve(PRESET).batch_size
        rate, first = tiny_steps_per_second(batch, args.tiny_crop, args.tiny_steps, compile)
        label = f"tiny-base ({PRESET}, batch {batch}, crop {args.tiny_crop})"
        print(f"{label}: {rate:.1f} steps/s (first step {first:.1f} s)")
        result["tiny_steps_per_s"] = rate
    print("RESULT " + json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
