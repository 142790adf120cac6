"""DVC stage `convert`: models/<name>/ (HF layout) -> models/converted/<name>/ (MLX npz)."""

import sa3mlx  # noqa: F401  (BLAS set-up first)
from sa3mlx.convert.model import ConvertOptions, convert_source
from sa3mlx.runtime.params import stage_params


def main() -> None:
    params = stage_params("convert")
    models = params["model"]
    options = ConvertOptions.from_params(params["convert"])
    for role in ("base", "arc"):
        name = models[role]
        manifest = convert_source(f"models/{name}", f"models/converted/{name}", options)
        print(
            f"convert {role}: models/{name} -> models/converted/{name} ({manifest['variant']}): "
            + ", ".join(f"{f} {i['keys']} keys" for f, i in manifest["files"].items())
        )


if __name__ == "__main__":
    main()
