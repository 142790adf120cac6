"""Data-parallel throughput model: per-step compute vs the all-reduce of the adapter gradients,
measured on 2 local ranks (ring back-end over loopback), projected to 2/4/8 ranks at 1/10/40 Gbit/s.

    python bench/dp.py [--depth 2] [--crop 256] [--rank 16] [--repeats 3] [--latency-us 50] [--step-s S]

Each rank times one compiled training step of its share (batch 1, `crop` latents) of the
small-music DiT (random weights, dora-rows adapters, `--depth` blocks: the step time is scaled to
the full 20 blocks), then the all-reduce (`World.average`, what training runs: one all_sum of the
loss and all gradients) of gradients the size of the full model's adapters (small-music dora-rows
r16: 9.2 M parameters, 37 MB fp32). Two ranks on a 2-core machine cannot show a speed-up, so the
scaling is projected with the ring all-reduce cost model (each rank sends and receives 2(p-1)/p
of the buffer in 2(p-1) hops):

    T_ar(p) = 2 (p-1) * alpha + 2 (p-1)/p * bytes / bandwidth
    efficiency(p) = T_step / (T_step + T_ar(p))       (no overlap: the average follows accumulation)

with T_step the full-depth per-rank step (the share stays the same: the global batch grows with p),
or `--step-s` for a faster machine than this one.
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np

import sa3mlx  # noqa: F401  (BLAS set-up before mlx: mlx is imported only below and in the functions)
from sa3mlx.train.distributed import DistributedSettings, World, launched, relaunch

FULL_DEPTH = 20
RANKS = (2, 4, 8)
LINKS_GBIT = (1, 10, 40)


def ring_allreduce_seconds(nbytes: float, ranks: int, gbit_per_s: float, latency_s: float) -> float:
    return 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) / ranks * nbytes / (gbit_per_s * 1e9 / 8)


def projection(step_s: float, nbytes: float, latency_s: float) -> dict:
    table = {}
    for ranks in RANKS:
        for link in LINKS_GBIT:
            ar = ring_allreduce_seconds(nbytes, ranks, link, latency_s)
            table[f"{ranks}x{link}G"] = {"allreduce_s": ar, "efficiency": step_s / (step_s + ar)}
    return table


def step_seconds(world: World, depth: int, crop: int, rank: int, repeats: int) -> tuple[list[float], int, int]:
    """(per-repeat seconds of this rank's compiled step, adapter params at `depth`, at full depth)."""
    import mlx.core as mx
    from dit import SIZES  # bench/dit.py and bench/train.py: the small-music set-up
    from train import PRESET, random_batch

    from sa3mlx.lora.inject import inject_adapters
    from sa3mlx.models.conditioning import Conditioner
    from sa3mlx.models.dit import DiT
    from sa3mlx.train.objective import ObjectiveConfig
    from sa3mlx.train.optim import AdamWConfig, make_adamw
    from sa3mlx.train.presets import resolve
    from sa3mlx.train.step import StepCore

    cfg = dataclasses.replace(SIZES["small"], depth=depth)
    train = resolve(PRESET, {"adapter": {"rank": rank}, "mask_padding_attention": True})  # as bench/train.py
    mx.random.seed(0)
    dit, cond = DiT(cfg), Conditioner(cfg.cond_token_dim)
    layers = inject_adapters(dit, cond, train.adapter, key=mx.random.key(0), materialize=False, announce=False)
    mx.eval(dit.parameters(), cond.parameters())
    objective = ObjectiveConfig.from_train_config(train)
    optimizer = make_adamw(AdamWConfig(train.lr, train.betas, train.eps, train.weight_decay))
    core = StepCore(dit, cond, layers, objective, optimizer, train.grad_clip, True)
    core.reduce = lambda loss, grads, count: (loss, grads)  # compute only: the all-reduce is timed on its own
    batch = random_batch(cfg, crop, objective, np.random.default_rng(world.rank))
    core.run([batch])  # compile
    times = []
    for _ in range(repeats):
        world.sum([0.0])  # start together
        start = time.perf_counter()
        core.run([batch])
        times.append(time.perf_counter() - start)
    sizes = {k: int(np.prod(v.shape)) for k, v in core.values.items()}
    in_blocks = sum(n for k, n in sizes.items() if ".transformer.layers." in k)
    per_block = in_blocks / depth
    return times, sum(sizes.values()), int(sum(sizes.values()) - in_blocks + per_block * FULL_DEPTH)


def allreduce_seconds(world: World, params: int, repeats: int) -> list[float]:
    """Seconds of `World.average` (what the training step runs: the loss and every gradient in
    one all_sum) over 64 fp32 gradient arrays holding `params` values."""
    import mlx.core as mx

    chunk = params // 64
    sizes = [chunk] * 63 + [params - 63 * chunk]
    grads = {f"g{i}": mx.random.normal((n,)) for i, n in enumerate(sizes)}
    loss = mx.array(1.0)
    mx.eval(grads)
    times = []
    for _ in range(repeats + 1):
        world.sum([0.0])
        start = time.perf_counter()
        mx.eval(world.average(loss, grads, 1))
        times.append(time.perf_counter() - start)
    return times[1:]  # the first call sets up the buffers


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def rank_main(args) -> int:
    world = World.current(DistributedSettings(ranks=2, timeout=900))
    times, params_here, params_full = step_seconds(world, args.depth, args.crop, args.rank, args.repeats)
    ar = allreduce_seconds(world, params_full, args.repeats)
    steps = world.sum([statistics.median(times)]) / world.size
    if not world.writer:
        return 0
    step_full = float(steps[0]) * FULL_DEPTH / args.depth
    projected_step = args.step_s or step_full
    nbytes = params_full * 4
    ar_median = statistics.median(ar)
    local_gbit = 2 * (world.size - 1) / world.size * nbytes * 8 / ar_median / 1e9
    result = {
        "ranks_measured": world.size,
        "depth": args.depth,
        "crop": args.crop,
        "adapter_params_depth": params_here,
        "adapter_params_full": params_full,
        "allreduce_mb": nbytes / 1e6,
        "step_s_depth": spread(times),
        "step_s_full_est": step_full,
        "allreduce_s": spread(ar),
        "loopback_effective_gbit_s": local_gbit,
        "latency_us": args.latency_us,
        "projected_step_s": projected_step,
        "projection": projection(projected_step, nbytes, args.latency_us * 1e-6),
    }
    print(
        f"rank step (batch 1, crop {args.crop}, depth {args.depth}): median {statistics.median(times):.3f} s "
        f"(min {min(times):.3f}, max {max(times):.3f}); x{FULL_DEPTH / args.depth:g} -> {step_full:.2f} s at depth "
        f"{FULL_DEPTH}"
    )
    print(
        f"all-reduce of {params_full / 1e6:.2f} M adapter params ({nbytes / 1e6:.1f} MB fp32) on {world.size} local "
        f"ranks: median {ar_median * 1e3:.1f} ms (min {min(ar) * 1e3:.1f}, max {max(ar) * 1e3:.1f}) = "
        f"{local_gbit:.1f} Gbit/s effective"
    )
    source = "--step-s" if args.step_s else "the measured step, scaled"
    hop = f"{args.latency_us:g} us per hop"
    print(f"projected efficiency, ring model, T_step {projected_step:.2f} s ({source}), {hop}:")
    print("  ranks  " + "".join(f"{link:>8} Gbit/s" for link in LINKS_GBIT))
    for ranks in RANKS:
        cells = "".join(f"{result['projection'][f'{ranks}x{link}G']['efficiency']:>15.1%}" for link in LINKS_GBIT)
        print(f"  {ranks:>5}  {cells}")
    print("RESULT " + json.dumps(result))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=2, help="DiT blocks timed (the step is scaled to 20)")
    parser.add_argument("--crop", type=int, default=256, help="latent frames per rank")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-us", type=float, default=50.0, help="per-hop latency of the projected links")
    parser.add_argument("--step-s", type=float, help="project with this per-rank step time (e.g. a Mac's or a GPU's)")
    args = parser.parse_args()
    if launched():
        return rank_main(args)
    return relaunch(DistributedSettings(ranks=2), [sys.executable, *sys.argv])


if __name__ == "__main__":
    sys.exit(main())
