"""DVC stage `svd`: models/converted/<base>/dit.npz -> models/svd/<base>/svd_bases.safetensors.

Sign-canonical SVD bases (top `svd.max_rank` columns, fp32) of every adaptable DiT and
conditioner weight, decomposed in fp32 from the weights in `svd.precision` (`stored` = as
dit.npz holds them, which is what training loads). -xs training and `sa3mlx lora merge
--svd-dir` use them, so an -xs adapter is always applied with the bases it was trained on.
"""

import sys
import time

import sa3mlx  # noqa: F401  (BLAS set-up first, as in every stage)
from sa3mlx.lora.bases import bases_metadata, compute_svd_file
from sa3mlx.runtime.params import stage_params


def main() -> int:
    declared = stage_params("svd")
    base, params = declared["model"]["base"], declared["svd"]
    source, out_dir = f"models/converted/{base}", f"models/svd/{base}"
    start = time.perf_counter()
    path = compute_svd_file(source, out_dir, int(params["max_rank"]), params["precision"])
    meta = bases_metadata(path)
    print(
        f"svd: {source}/dit.npz -> {path}: {meta['layers']} layers, top {meta['max_rank']} columns, "
        f"decomposed from {meta['precision']} weights in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
