"""Where the time of one DiT forward and one LoRA training step goes, per op, at small-music dims.

    python bench/profile.py [--crop 256] [--depth 20] [--repeats 5] [--whole-depth 2]

Each op of a transformer block runs alone at its real shapes (batch 1, `crop` latent frames + 64
memory tokens, 257 prompt tokens, E 1024, 16 heads, FF 4096, dora-rows r16 adapters): forward,
and forward+backward (the VJP w.r.t. its inputs, plus the adapter tensors for the adapter
branch), on each kernel path of `runtime/kernels.py` in this one run: MLX's own ("mlx"), the
MLX-compiled ones ("compiled") and the native C++ ones ("native"). Times are the minimum of the
repeats (the paths interleaved, so that load from other processes hits all alike), times the op's count
per forward (per block times depth). Then the whole DiT forward and forward+backward
at `--whole-depth` blocks for comparison with the sum, and the fp32 GEMM peak measured in the
same run. Last line: RESULT {json} with the per-op totals in ms.
"""

from __future__ import annotations

# isort: off
import sa3mlx  # noqa: F401  (BLAS set-up: must precede the first mlx import)
# isort: on

import argparse
import dataclasses
import json
import os
import time

import mlx.core as mx
import mlx.nn as nn
from blas import mlx_gemm  # bench/blas.py: shared timing and GEMM measurement
from dit import PROMPT_TOKENS, SIZES  # bench/dit.py: the small-music config

from sa3mlx.lora.layers import wrap
from sa3mlx.models.attention import attention
from sa3mlx.models.dit import DiT
from sa3mlx.models.dit_layers import RMSNorm, apply_rope
from sa3mlx.runtime import kernels

PATHS = (kernels.MLX, kernels.COMPILED, kernels.NATIVE)  # `runtime/kernels.py`: MLX's own, MLX-compiled, C++


def block_ops(cfg, crop: int) -> list[tuple[str, int, callable, list[mx.array], list[mx.array]]]:
    """(name, count per block, fn, differentiated inputs, extra trainable tensors)."""
    E, H, F, L, N = cfg.embed_dim, cfg.num_heads, cfg.ff_inner, crop + cfg.num_memory_tokens, PROMPT_TOKENS
    D = E // H
    key = iter(mx.random.split(mx.random.key(0), 64))

    def rand(*shape):
        return mx.random.normal(shape, key=next(key))

    x, ctx = rand(1, L, E), rand(1, N, E)
    q, k, v, kc = rand(1, H, L, D), rand(1, H, L, D), rand(1, H, L, D), rand(1, H, N, D)
    scores, cross_scores, gate_in = rand(1, H, L, L), rand(1, H, L, N), rand(1, L, 2 * F)
    mod = rand(1, 1, E)
    angles = mx.arange(L, dtype=mx.float32)[:, None] * mx.exp(-mx.arange(D // 2) / 4.0)[None]
    rope = (mx.cos(mx.concatenate([angles, angles], -1)), mx.sin(mx.concatenate([angles, angles], -1)))
    norm = RMSNorm(E)
    linears = {
        "to_qkv": nn.Linear(E, 3 * E, bias=False),
        "to_out": nn.Linear(E, E, bias=False),
        "to_kv": nn.Linear(E, 2 * E, bias=False),
        "ff_in": nn.Linear(E, 2 * F),
        "ff_out": nn.Linear(F, E),
    }
    adapted = wrap(linears["ff_in"], "dora-rows", 16, key=next(key), materialize=False)
    adapter_names = sorted(adapted.adapter_tensors())

    def adapter_branch(a, *tensors):
        adapted.update(dict(zip(adapter_names, tensors)))  # traced tensors, so the VJP reaches them
        return adapted(a) - linears["ff_in"](a)

    xf = rand(1, L, F)
    adapter_tensors = [adapted.adapter_tensors()[n] for n in adapter_names]

    return [
        ("gemm to_qkv", 1, lambda a: linears["to_qkv"](a), [x], []),
        ("gemm to_out (self, cross)", 2, lambda a: linears["to_out"](a), [x], []),
        ("gemm cross to_q", 1, lambda a: linears["to_out"](a), [x], []),
        ("gemm cross to_kv", 1, lambda a: linears["to_kv"](a), [ctx], []),
        ("gemm ff in", 1, lambda a: linears["ff_in"](a), [x], []),
        ("gemm ff out", 1, lambda a: linears["ff_out"](a), [xf], []),
        ("gemm attention QK^T, AV", 1, lambda a, b, c: (a @ b.swapaxes(-1, -2)) @ c / L, [q, k, v], []),
        ("gemm cross QK^T, AV", 1, lambda a, b: (a @ b.swapaxes(-1, -2)) @ b / N, [q, kc], []),
        ("softmax self-attention", 1, kernels.softmax, [scores], []),
        ("softmax cross-attention", 1, kernels.softmax, [cross_scores], []),
        ("attention self (whole op)", 1, lambda a, b, c: attention(a, b, c, D**-0.5), [q, k, v], []),
        ("SiLU gate (SwiGLU)", 1, kernels.swiglu, [gate_in], []),
        ("SiLU local embed", 1, kernels.silu, [rand(1, crop, E)], []),
        ("RMSNorm block (x3)", 3, norm, [x], []),
        ("RMSNorm q/k (x4)", 4, RMSNorm(D), [q], []),
        ("RoPE q, k (x2)", 2, lambda a: apply_rope(a, *rope), [q], []),
        ("adaLN modulate + gates", 2, lambda a, s, g: a * (1 + s) + a * kernels.sigmoid(1 - g), [x, mod, mod], []),
        ("adapter branch ff in (dora-rows r16)", 1, adapter_branch, [x], adapter_tensors),
    ]


def op_step(fn, inputs: list, extra: list, backward: bool):
    """A call that evaluates the op's forward, or its VJP w.r.t. all inputs and extra tensors."""
    if not backward:
        return lambda: mx.eval(fn(*inputs, *extra))
    cotangent = mx.random.normal(fn(*inputs, *extra).shape, key=mx.random.key(1))
    mx.eval(cotangent)
    return lambda: mx.eval(mx.vjp(fn, [*inputs, *extra], [cotangent]))


def time_paths(step, repeats: int) -> dict[str, float]:
    """Min seconds of `step` per kernel path, the paths interleaved so load changes hit both alike."""
    times = {path: [] for path in PATHS}
    for attempt in range(repeats + 1):  # the first round warms up (and compiles) each path
        for path in PATHS:
            os.environ.update(kernels.ENVIRONMENT[path])
            start = time.perf_counter()
            step()
            if attempt:
                times[path].append(time.perf_counter() - start)
    return {path: min(t) for path, t in times.items()}


def whole_model(cfg, crop: int, repeats: int) -> dict[str, list[float]]:
    """{path: [forward s, forward+backward s]} of the whole DiT, min over the repeats."""
    mx.random.seed(0)
    dit = DiT(cfg)
    mx.eval(dit.parameters())
    x, t = mx.random.normal((1, cfg.io_channels, crop)), mx.array([0.7])
    cross, glob = mx.random.normal((1, PROMPT_TOKENS, cfg.cond_token_dim)), mx.random.normal((1, cfg.global_cond_dim))
    local = mx.zeros((1, cfg.local_add_cond_dim, crop))
    grad = mx.grad(lambda x_: (dit(x_, t, cross, glob, local) ** 2).mean())
    forward = time_paths(lambda: mx.eval(dit(x, t, cross, glob, local)), repeats)
    both = time_paths(lambda: mx.eval(grad(x)), repeats)
    return {path: [forward[path], both[path]] for path in PATHS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crop", type=int, default=256)
    parser.add_argument("--depth", type=int, default=20, help="blocks the per-op totals count")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--whole-depth", type=int, default=2, help="blocks of the whole-model timing")
    args = parser.parse_args()
    cfg = SIZES["small"]
    gemm = mlx_gemm(2048, 5)
    print(f"MLX {mx.__version__} on {mx.default_device()}; fp32 GEMM n=2048: {gemm:.1f} GFLOP/s")
    print(f"small-music dims, crop {args.crop}, ms per forward of {args.depth} blocks (op time x count x depth)")
    ops = block_ops(cfg, args.crop)
    table = {}
    for name, count, fn, inputs, extra in ops:
        row = table.setdefault(name, {})
        for phase, backward in (("fwd", False), ("fwdbwd", True)):
            for path, seconds in time_paths(op_step(fn, inputs, extra, backward), args.repeats).items():
                row[f"{path}_{phase}"] = 1e3 * count * args.depth * seconds
    columns = [f"{path}_{phase}" for phase in ("fwd", "fwdbwd") for path in PATHS]
    print(f"{'op':<40}" + "".join(f"{c.replace('_fwdbwd', ' f+b').replace('_fwd', ' fwd'):>14}" for c in columns))
    for name, row in table.items():
        print(f"{name:<40}" + "".join(f"{row[c]:14.1f}" for c in columns))
    small_depth = dataclasses.replace(cfg, depth=args.whole_depth)
    whole = {p: [1e3 * s for s in v] for p, v in whole_model(small_depth, args.crop, args.repeats).items()}
    for path, (fwd, both) in whole.items():
        print(f"whole DiT d{args.whole_depth} ({path}): forward {fwd:.0f} ms, fwd+bwd {both:.0f} ms")
    gemm = max(gemm, mlx_gemm(2048, 5))
    print(f"fp32 GEMM peak of this run: {gemm:.1f} GFLOP/s")
    result = {"gemm_gflops": gemm, "depth": args.depth, "crop": args.crop, "ops_ms": table, "whole_ms": whole}
    print("RESULT " + json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
