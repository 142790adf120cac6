"""DVC stage `svd`: models/converted/<base>/dit.npz -> models/svd/<base>/svd_bases.safetensors.

Sign-canonical SVD bases (top `svd.max_rank` columns, fp32) of every adaptable DiT and
conditioner weight, decomposed in fp32 from the weights in `svd.precision` (`stored` = as
dit.npz holds them, which is what training loads). -xs training and `sa3mlx lora merge
--svd-dir` use them, so an -xs adapter is always applied with the bases it was trained on.
"""

import time

import sa3mlx  # noqa: F401  (BLAS set-up first, as in every stage)
from sa3mlx.lora.bases import SVD_PARAMS, bases_metadata, compute_svd_file
from sa3mlx.runtime.errors import run_stage
from sa3mlx.runtime.layout import DIT_FILE, converted_dir, svd_dir
from sa3mlx.runtime.params import stage_params
from sa3mlx.runtime.schema import check_section


def main() -> int:
    declared = stage_params("svd")
    base = declared["model"]["base"]
    params = check_section("svd", dict(declared["svd"]), SVD_PARAMS)
    source, out_dir = converted_dir(base), svd_dir(base)
    start = time.perf_counter()
    path = compute_svd_file(source, out_dir, params["max_rank"], params["precision"])
    meta = bases_metadata(path)
    print(
        f"svd: {source}/{DIT_FILE} -> {path}: {meta['layers']} layers, top {meta['max_rank']} columns, "
        f"decomposed from {meta['precision']} weights in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    run_stage("svd", main)
