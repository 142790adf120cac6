"""DVC stage `convert`: models/<name>/ (HF layout) -> models/converted/<name>/ (MLX npz)."""

import sa3mlx  # noqa: F401  (BLAS set-up first)
from sa3mlx.convert.model import ConvertOptions, check_source_folder, convert_source
from sa3mlx.runtime.errors import run_stage
from sa3mlx.runtime.layout import converted_dir, source_model_dir
from sa3mlx.runtime.params import stage_params


def main() -> int:
    params = stage_params("convert")
    models = params["model"]
    options = ConvertOptions.from_params(params["convert"])
    roles = ("base", "arc")
    for role in roles:  # every folder checked before anything is written
        check_source_folder(source_model_dir(models[role]), f"model.{role}")
    for role in roles:
        source, out = source_model_dir(models[role]), converted_dir(models[role])
        manifest = convert_source(source, out, options)
        print(
            f"convert {role}: {source} -> {out} ({manifest['variant']}): "
            + ", ".join(f"{f} {i['keys']} keys" for f, i in manifest["files"].items())
        )
    return 0


if __name__ == "__main__":
    run_stage("convert", main)
