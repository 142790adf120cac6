"""MLX fp32 GEMM throughput vs numpy's on this machine, side by side in one run.

    python bench/blas.py [--sizes 512 1024 2048] [--repeats 7]

Prints GFLOP/s (median of the repeats) for MLX with the BLAS sa3mlx selected, for
numpy, their ratio (target >= 0.8 on Linux), and, measured in a child process,
MLX with its bundled reference BLAS for comparison. Exit status 1 if the ratio at
the largest size is below 0.8.
"""

from __future__ import annotations

import sa3mlx  # noqa: F401  (first: sets MLX's BLAS up before mlx is imported)

# isort: split

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# isort: split
import mlx.core as mx
import numpy as np

from sa3mlx.runtime import blas

TARGET_RATIO = 0.8


def repeat_seconds(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn, repeats: int) -> float:
    return statistics.median(repeat_seconds(fn, repeats))


def spread(times: list[float], scale: float = 1.0) -> dict:
    """min / median / max of `times`, times `scale` (e.g. 1e3 for ms)."""
    return {"min": scale * min(times), "median": scale * statistics.median(times), "max": scale * max(times)}


def gflops(n: int, seconds: float) -> float:
    return 2 * n**3 / seconds / 1e9


def mlx_gemm(n: int, repeats: int) -> float:
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    return gflops(n, median_seconds(lambda: mx.eval(a @ b), repeats))


def numpy_gemm(n: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    return gflops(n, median_seconds(lambda: a @ b, repeats))


def reference_blas(sizes: list[int], repeats: int) -> dict:
    """MLX GEMM with the bundled reference BLAS, measured in a child process."""
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import blas as b; "
        f"print(json.dumps({{n: b.mlx_gemm(n, {repeats}) for n in {sizes!r}}}))"
    )
    env = {**os.environ, "SA3MLX_BLAS": "off"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    return {int(k): v for k, v in json.loads(out.stdout).items()} if out.returncode == 0 else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-reference", action="store_true", help="skip the slow reference-BLAS run")
    args = parser.parse_args()

    status = blas.status()
    print(
        f"MLX {mx.__version__} on {mx.default_device()}; BLAS: {status['library'] or 'bundled'} "
        f"({status['source'] or 'reference'})"
    )
    reference = {} if args.no_reference or not status["library"] else reference_blas(args.sizes[:2], 3)
    print(f"{'n':>6} {'mlx GF/s':>10} {'numpy GF/s':>11} {'ratio':>7} {'ref-BLAS GF/s':>14}")
    ratio = 0.0
    for n in args.sizes:
        ours, theirs = mlx_gemm(n, args.repeats), numpy_gemm(n, args.repeats)
        ratio = ours / theirs
        ref = f"{reference[n]:14.1f}" if n in reference else f"{'-':>14}"
        print(f"{n:>6} {ours:10.1f} {theirs:11.1f} {ratio:7.2f} {ref}")
    verdict = "ok" if ratio >= TARGET_RATIO else "BELOW TARGET"
    print(f"ratio at n={args.sizes[-1]}: {ratio:.2f} (target >= {TARGET_RATIO}) {verdict}")
    return 0 if ratio >= TARGET_RATIO or not sys.platform.startswith("linux") else 1


if __name__ == "__main__":
    sys.exit(main())
