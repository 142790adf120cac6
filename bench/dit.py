"""DiT throughput at the real SA3 sizes vs this machine's fp32 GEMM peak, measured in one run.

    python bench/dit.py [--model small medium] [--depth N] [--crop 256] [--repeats 2] [--gemm-n 2048]

Random weights, batch 1, `crop` latent frames + 64 memory tokens, 257 prompt+seconds tokens.
Prints per model: forward ms, forward+backward ms (gradient w.r.t. the input latents, the
activation-gradient pass LoRA training needs), achieved GFLOP/s from an analytic count of the
matmul FLOPs, the measured MLX fp32 GEMM GFLOP/s (`bench/blas.py`), their ratio and peak memory.
Target on CPU: forward+backward >= 50 % of the GEMM figure.
"""

from __future__ import annotations

import sa3mlx  # noqa: F401  (first: sets MLX's BLAS up before mlx is imported)

# isort: split

import argparse
import dataclasses

import mlx.core as mx
from blas import median_seconds, mlx_gemm  # bench/blas.py: shared GEMM measurement and timing

from sa3mlx.models.config import DiTConfig
from sa3mlx.models.dit import DiT

TARGET = 0.5
PROMPT_TOKENS = 257  # 256 prompt tokens + the seconds token
SIZES = {  # the official small-music and medium DiT configs
    "small": DiTConfig(
        io_channels=256,
        embed_dim=1024,
        depth=20,
        num_heads=16,
        cond_token_dim=768,
        global_cond_dim=768,
        local_add_cond_dim=257,
        num_memory_tokens=64,
        timestep_features_dim=256,
        ff_inner=4096,
        differential=False,
    ),
    "medium": DiTConfig(
        io_channels=256,
        embed_dim=1536,
        depth=24,
        num_heads=24,
        cond_token_dim=768,
        global_cond_dim=768,
        local_add_cond_dim=257,
        num_memory_tokens=64,
        timestep_features_dim=256,
        ff_inner=6144,
        differential=True,
    ),
}


def matmul_flops(cfg: DiTConfig, T: int, N: int = PROMPT_TOKENS) -> tuple[float, float]:
    """(linear-layer FLOPs, attention-score/value FLOPs) of one forward, batch 1."""
    E, C, F, L = cfg.embed_dim, cfg.io_channels, cfg.ff_inner, cfg.num_memory_tokens + T
    pairs = 2 if cfg.differential else 1  # differential attention runs two SDPAs
    per_block = (
        L * E * (5 if cfg.differential else 3) * E  # to_qkv
        + L * E * E * (1 + pairs)
        + N * E * (1 + pairs) * E  # self to_out; cross to_q, to_kv
        + L * E * E  # cross to_out
        + T * cfg.local_add_cond_dim * E
        + T * E * E  # to_local_embed
        + L * E * 2 * F
        + L * F * E
    )  # SwiGLU
    top = (
        N * cfg.cond_token_dim * E
        + N * E * E  # to_cond_embed
        + 2 * T * C * C
        + 2 * T * C * E
    )  # pre/post convs, project_in/out
    attention = pairs * 2 * (L * L * E + L * N * E)  # QK^T and AV, self and cross
    return 2.0 * (cfg.depth * per_block + top), 2.0 * cfg.depth * attention


def median_ms(fn, repeats: int) -> float:
    return 1e3 * median_seconds(fn, repeats)


def bench_model(name: str, cfg: DiTConfig, crop: int, repeats: int, backward: bool) -> dict:
    mx.random.seed(0)
    dit = DiT(cfg)
    mx.eval(dit.parameters())
    x = mx.random.normal((1, cfg.io_channels, crop))
    t = mx.array([0.7])
    cross = mx.random.normal((1, PROMPT_TOKENS, cfg.cond_token_dim))
    glob = mx.random.normal((1, cfg.global_cond_dim))
    local = mx.zeros((1, cfg.local_add_cond_dim, crop))
    mx.eval(x, cross, glob, local)
    mx.reset_peak_memory()
    forward = median_ms(lambda: mx.eval(dit(x, t, cross, glob, local)), repeats)
    linear, attention = matmul_flops(cfg, crop)
    row = {"name": name, "forward_ms": forward, "forward_gflops": (linear + attention) / forward / 1e6}
    if backward:
        loss_grad = mx.grad(lambda x_: (dit(x_, t, cross, glob, local) ** 2).mean())
        both = median_ms(lambda: mx.eval(loss_grad(x)), repeats)
        # backward w.r.t. the input: dX = dY·W per linear layer, and dQ, dK, dV (twice the forward) in attention
        row.update(train_ms=both, train_gflops=(2 * linear + 3 * attention) / both / 1e6)
    row["peak_gb"] = mx.get_peak_memory() / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--depth", type=int, help="override the depth (fewer blocks, same per-block shapes)")
    parser.add_argument("--crop", type=int, default=256, help="latent frames")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gemm-n", type=int, default=2048)
    parser.add_argument(
        "--forward-only",
        nargs="*",
        default=[],
        choices=list(SIZES),
        help="models to time without the backward pass (e.g. where memory is short)",
    )
    args = parser.parse_args()

    gemms = [mlx_gemm(args.gemm_n, 5)]
    print(f"MLX {mx.__version__} on {mx.default_device()}; fp32 GEMM n={args.gemm_n}: {gemms[0]:.1f} GFLOP/s")
    print(
        f"{'model':<14}{'fwd ms':>10}{'fwd GF/s':>10}{'ratio':>7}{'fwd+bwd ms':>12}{'GF/s':>8}{'ratio':>7}"
        f"{'peak GB':>9}"
    )
    for name in args.model:
        cfg = SIZES[name] if args.depth is None else dataclasses.replace(SIZES[name], depth=args.depth)
        row = bench_model(name, cfg, args.crop, args.repeats, backward=name not in args.forward_only)
        mx.clear_cache()
        gemms.append(mlx_gemm(args.gemm_n, 5))  # again after the model: the peak of the two is the reference
        gemm = max(gemms[-2:])
        label = f"{name}/d{cfg.depth}"
        train = (
            f"{row['train_ms']:12.0f}{row['train_gflops']:8.1f}{row['train_gflops'] / gemm:7.2f}"
            if "train_ms" in row
            else f"{'(skipped)':>12}{'-':>8}{'-':>7}"
        )
        print(
            f"{label:<14}{row['forward_ms']:10.0f}{row['forward_gflops']:10.1f}{row['forward_gflops'] / gemm:7.2f}"
            f"{train}{row['peak_gb']:9.2f}"
        )
        if "train_ms" in row:
            ratio = row["train_gflops"] / gemm
            print(
                f"  {label} forward+backward at {ratio:.0%} of GEMM peak {gemm:.1f} GFLOP/s "
                f"(target >= {TARGET:.0%}) {'ok' if ratio >= TARGET else 'BELOW TARGET'}"
            )


if __name__ == "__main__":
    main()
