"""Peak memory and s/step of a LoRA training step at the real SA3 sizes, with and without gradient
checkpointing, each case in its own process; and the fit of `sa3mlx/train/memory.py`'s model.

    python bench/memory.py [--repeats 2] [--cases small:20:256:off ...] [--medium-depths 2 4]
    python bench/memory.py --fit          # the estimator's constants from small blocks at d1/d2

A case is `model:depth:crop:off|on[:stored]` (model small = small-music, medium = E 1536 d24 24
heads differential; random weights, batch 1, the bench/train.py step: dora-rows r16, dashboard
objective, compiled; `stored`: the frozen base kept in fp16 as dit.npz stores it, `train.base_dtype:
stored`, else cast to fp32 at load). Per case: `mx.get_peak_memory`, the process's max RSS, s/step
(min/median/max of the repeats after the compiling first step), % of the same process's fp32
GEMM peak (the matmul FLOPs of the step; a checkpointed step's recompute not counted) and the
estimate of sa3mlx.train.memory beside it. Medium at crop 4096 is measured at `--medium-depths`
with checkpointing and the base stored in fp16 (what the trainer's rule picks there: with the base
in fp32 the step cannot fit 8 GB) and projected linearly to depth 24 (marked "projected").
Targets (fp32 CPU): small crop 1300 checkpointed <= 6 GB; medium crop 4096 <= 8 GB projected;
the crop-1300 step >= 45 % of the GEMM peak (issue 14; 40 % before). Last line: RESULT {json}.
"""

from __future__ import annotations

import sa3mlx  # noqa: F401  (first: sets MLX's BLAS up before mlx is imported)

# isort: split

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys

import mlx.core as mx
from blas import mlx_gemm  # bench/blas.py
from dit import SIZES, matmul_flops  # bench/dit.py
from train import random_step, time_steps  # bench/train.py

from sa3mlx.runtime.precision import COMPUTE, STORED
from sa3mlx.train.memory import GB, StepShape, base_weight_bytes, dit_parameter_count, estimate_peak_bytes

TARGETS = {"small_1300_ckpt_peak_gb": 6.0, "medium_4096_ckpt_projected_gb": 8.0, "small_1300_pct_gemm": 45.0}
DEFAULT_CASES = ("small:20:1300:on", "small:20:1300:off", "small:20:256:off", "small:20:256:on")
# plain: d1/d2 at two crops (ALPHA, BETA); checkpointed: d2/d4 (at d1 the one block is the recomputed one)
FIT_CASES = (
    *(f"small:{d}:{c}:off" for c in (256, 1300) for d in (1, 2)),
    *(f"small:{d}:1300:on" for d in (2, 4)),
)
GEMM_N = 2048


def parse_case(text: str) -> dict:
    model, depth, crop, ckpt, *base = text.split(":")
    if model not in SIZES or ckpt not in ("on", "off") or base not in ([], ["stored"]):
        raise SystemExit(f"bad case '{text}': expected small|medium:DEPTH:CROP:on|off[:stored]")
    return {"model": model, "depth": int(depth), "crop": int(crop), "ckpt": ckpt == "on", "stored": bool(base)}


def max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def run_case(case: dict, repeats: int) -> dict:
    """One case in this process (the child side)."""
    gemm = mlx_gemm(GEMM_N, 3)
    cfg = dataclasses.replace(SIZES[case["model"]], depth=case["depth"])
    base = mx.float16 if case["stored"] else mx.float32
    core, batch, _ = random_step(cfg, case["crop"], 16, False, True, grad_checkpoint=case["ckpt"], dtype=base)
    mx.reset_peak_memory()
    first, times = time_steps(core, batch, repeats)
    timed_first = not times  # --repeats 0: memory only; the one step's time includes the compile
    times = times or [first]
    peak = mx.get_peak_memory()
    del core, batch
    mx.clear_cache()
    gemm = max(gemm, mlx_gemm(GEMM_N, 3))
    linear, attention = matmul_flops(cfg, case["crop"])
    median = statistics.median(times)
    shape = StepShape(case["crop"], 1, case["ckpt"])
    weights = weight_bytes(cfg, case)
    return {
        **case,
        "peak_gb": peak / GB,
        "rss_gb": max_rss_bytes() / GB,
        "estimate_gb": estimate_peak_bytes(cfg, shape, weights) / GB,
        "weights_gb": weights / GB,
        "first_s": first,
        "step_s": [min(times), median, max(times)],
        "timed_first": timed_first,
        "gemm_gflops": gemm,
        "pct_gemm": 100.0 * (2 * linear + 3 * attention) / median / 1e9 / gemm,
    }


def weight_bytes(cfg, case: dict) -> float:
    """The DiT's weights during the step, as sa3mlx.train.memory counts them."""
    compute = 4 * dit_parameter_count(cfg)
    return base_weight_bytes(STORED if case["stored"] else COMPUTE, case["ckpt"], compute, compute // 2)


def spawn(case: str, repeats: int) -> dict:
    """Run one case in a fresh process (its own peak and RSS)."""
    cmd = [sys.executable, __file__, "--child", case, "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"case {case} failed (exit {proc.returncode})")
    return json.loads(lines[-1][5:])


def describe(row: dict, projected: bool = False) -> str:
    lo, mid, hi = row["step_s"]
    mark = " (projected)" if projected else " (one step, incl. the compile)" if row.get("timed_first") else ""
    return (
        f"{row['model']:<7}d{row['depth']:<3}crop {row['crop']:<5}ckpt {'on ' if row['ckpt'] else 'off'}  "
        f"base {'fp16' if row.get('stored') else 'fp32'}  "
        f"peak {row['peak_gb']:6.2f} GB  rss {row.get('rss_gb', float('nan')):6.2f} GB  "
        f"estimate {row['estimate_gb']:6.2f} GB  s/step {lo:7.2f} / {mid:7.2f} / {hi:7.2f}  "
        f"{row.get('pct_gemm', float('nan')):4.0f}% GEMM{mark}"
    )


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line (exact through two points)."""
    mx_, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx_) ** 2 for x in xs)
    return slope, my - slope * mx_


def project(rows: list[dict], depth: int) -> dict:
    """The medium rows' peak, RSS and s/step extrapolated linearly in depth."""
    depths = [r["depth"] for r in rows]
    out = {**rows[0], "depth": depth}
    for key in ("peak_gb", "rss_gb"):
        slope, intercept = linear_fit(depths, [r[key] for r in rows])
        out[key] = intercept + slope * depth
    # min, median and max each fitted on their own can cross at the far end: report them in order
    out["step_s"] = sorted(
        intercept + slope * depth
        for slope, intercept in (linear_fit(depths, [r["step_s"][i] for r in rows]) for i in range(3))
    )
    cfg = dataclasses.replace(SIZES[rows[0]["model"]], depth=depth)
    shape = StepShape(rows[0]["crop"], 1, rows[0]["ckpt"])
    out["estimate_gb"] = estimate_peak_bytes(cfg, shape, weight_bytes(cfg, rows[0])) / GB
    out.pop("pct_gemm", None)
    return out


def fit(rows: list[dict]) -> dict:
    """ALPHA, BETA, CKPT_KEPT and the overhead of sa3mlx.train.memory from d1/d2 pairs."""
    cfg = SIZES["small"]
    by = {(r["depth"], r["crop"], r["ckpt"]): r["peak_gb"] * GB - r["weights_gb"] * GB for r in rows}
    crops = sorted({r["crop"] for r in rows})
    # per-block activation bytes a(L) = 4·(ALPHA·L·E + BETA·H·L²): two crops, two unknowns
    slopes = {c: by[(2, c, False)] - by[(1, c, False)] for c in crops}
    lengths = [c + cfg.num_memory_tokens for c in crops]
    (l1, l2), (s1, s2) = lengths, [slopes[c] for c in crops]
    E, H = cfg.embed_dim, cfg.num_heads
    beta = (s2 / l2 - s1 / l1) / (4 * H * (l2 - l1))
    alpha = (s1 / l1 - 4 * beta * H * l1) / (4 * E)
    ckpt = sorted((d, c) for d, c, on in by if on)
    (d1, crop), (d2, _) = ckpt[0], ckpt[-1]
    kept = (by[(d2, crop, True)] - by[(d1, crop, True)]) / (d2 - d1) / (4 * (crop + cfg.num_memory_tokens) * E)
    overhead = [by[(1, c, False)] - slopes[c] for c in crops]
    return {"ALPHA": alpha, "BETA": beta, "CKPT_KEPT": kept, "OVERHEAD_GB": max(overhead) / GB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES))
    # not depth 1: there the one block is also the recomputed one, which breaks the linear trend
    parser.add_argument("--medium-depths", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--medium-crop", type=int, default=4096)
    parser.add_argument("--fit", action="store_true", help="measure the estimator's constants instead")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("CASE " + json.dumps(run_case(parse_case(args.child), args.repeats)), flush=True)
        return

    print(f"MLX {mx.__version__} on {mx.default_device()}; each case in its own process, batch 1, fp32")
    if args.fit:
        rows = [spawn(case, 1) for case in FIT_CASES]
        for row in rows:
            print(describe(row), flush=True)
        constants = fit(rows)
        print("fitted (put these in sa3mlx/train/memory.py): " + json.dumps(constants))
        print("RESULT " + json.dumps({"fit": constants}))
        return
    result = {}
    for case in args.cases:
        row = spawn(case, args.repeats)
        print(describe(row), flush=True)
        key = f"{row['model']}_{row['crop']}{'_ckpt' if row['ckpt'] else ''}"
        result[f"{key}_peak_gb"] = round(row["peak_gb"], 3)
        result[f"{key}_rss_gb"] = round(row["rss_gb"], 3)
        result[f"{key}_estimate_gb"] = round(row["estimate_gb"], 3)
        result[f"{key}_s_per_step"] = [round(s, 2) for s in row["step_s"]]
        if not row["timed_first"]:
            result[f"{key}_pct_gemm"] = round(row["pct_gemm"], 1)
    medium = [spawn(f"medium:{d}:{args.medium_crop}:on:stored", args.repeats) for d in args.medium_depths]
    for row in medium:
        print(describe(row), flush=True)
    if len(medium) >= 2:
        full = project(medium, SIZES["medium"].depth)
        print(describe(full, projected=True))
        if full["peak_gb"] < max(r["peak_gb"] for r in medium):
            print("warning: the projection falls below the measured points; measure at depths >= 2")
        key = f"medium_{args.medium_crop}_ckpt"
        result[f"{key}_projected_gb"] = round(full["peak_gb"], 3)
        result[f"{key}_projected_rss_gb"] = round(full["rss_gb"], 3)
        result[f"{key}_projected_s_per_step"] = [round(s, 1) for s in full["step_s"]]
        result[f"{key}_estimate_gb"] = round(full["estimate_gb"], 3)
        result[f"{key}_measured"] = {r["depth"]: round(r["peak_gb"], 3) for r in medium}
    for key, target in TARGETS.items():
        if key in result:
            ok = result[key] >= target if key.endswith("pct_gemm") else result[key] <= target
            print(
                f"{key}: {result[key]} (target {'>=' if key.endswith('pct_gemm') else '<='} {target}) "
                f"{'ok' if ok else 'MISSED'}"
            )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
