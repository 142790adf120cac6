"""`sa3mlx doctor`: check a project before `dvc repro`: every stage's params, the model folders
(before DVC's own "missing dependency"), normalize.sample_rate against the codec, and data/raw.

Each problem is one `sa3mlx: doctor: <message>` line (the same words the stage itself would use);
exit status 2 when there is any, 0 when all is well.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from sa3mlx.runtime.errors import USER_ERROR_STATUS, UserError, one_line
from sa3mlx.runtime.layout import MODEL_CONFIG_FILE, RAW_DIR, source_model_dir
from sa3mlx.runtime.params import stage_params
from sa3mlx.runtime.schema import check_section, flag


def _convert(params) -> None:
    from sa3mlx.convert.model import ConvertOptions, check_source_folder

    ConvertOptions.from_params(params["convert"])
    for role in ("base", "arc"):
        check_source_folder(source_model_dir(params["model"][role]), f"model.{role}")


def _svd(params) -> None:
    from sa3mlx.lora.bases import SVD_PARAMS

    check_section("svd", dict(params["svd"]), SVD_PARAMS)


def _normalize(params) -> None:
    from sa3mlx.audio.normalize import Options, check_codec_rate

    options = Options.from_params(params["normalize"])
    base = params["model"]["base"]
    check_codec_rate(options.sample_rate, source_model_dir(base) / MODEL_CONFIG_FILE, base)


def _encode(params) -> None:
    from sa3mlx.data.encode import EncodeOptions

    EncodeOptions.from_params(dict(params["encode"]))


def _train(params) -> None:
    from sa3mlx.train.job import TrainJob

    TrainJob.from_params(params["train"], base=params["model"]["base"], arc=params["model"]["arc"])


def _demo(params) -> None:
    from sa3mlx.sample.demo_entries import checked_entries
    from sa3mlx.sample.render import RenderOptions

    demo = params["demo"]
    checked_entries("demo.entries", demo["entries"], demo.get("defaults"))
    RenderOptions.from_params(demo)
    flag().check("demo.baselines", demo.get("baselines", True))


STAGE_CHECKS: dict[str, Callable] = {
    "convert": _convert,
    "svd": _svd,
    "normalize": _normalize,
    "encode": _encode,
    "train": _train,
    "demo": _demo,
}


def check_raw() -> None:
    raw = Path(RAW_DIR)
    if not raw.is_dir() or not any(p.is_file() for p in raw.rglob("*")):
        raise UserError(f'{RAW_DIR} is empty or missing: put your audio there (README "Train on your own music")')


def problems() -> list[str]:
    """One line per problem found in the project of the working directory, in pipeline order."""
    found = []
    for stage, check in STAGE_CHECKS.items():
        try:
            check(stage_params(stage))
        except UserError as e:
            found.append(f"{stage}: {one_line(e)}")
    try:
        check_raw()
    except UserError as e:
        found.append(f"normalize: {one_line(e)}")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(f"sa3mlx: doctor: {line}", file=sys.stderr)
    if found:
        return USER_ERROR_STATUS
    print(f"sa3mlx doctor: params, model folders and {RAW_DIR} look right; run `dvc repro`")
    return 0
