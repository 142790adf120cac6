"""The `sa3mlx` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before anything imports mlx)


def _convert(args) -> int:
    from sa3mlx.convert.model import ConvertOptions, convert_source

    options = ConvertOptions(
        dit_dtype=args.dit_dtype,
        same_dtype=args.same_dtype,
        t5gemma_dtype=args.t5gemma_dtype,
        allow_pickle=args.allow_pickle,
        dit_only=args.dit_only,
    )
    manifest = convert_source(args.source, args.out_dir, options)
    for name, info in manifest["files"].items():
        print(f"{Path(args.out_dir) / name}: {info['keys']} keys, {'/'.join(info['dtypes'])}")
    return 0


def _parity(args) -> int:
    from sa3mlx.parity.run import check, default_fixture_dirs, recompute

    words = args.words
    if words and words[0] == "check":
        if len(words) not in (2, 3):
            raise SystemExit("usage: sa3mlx parity check KIND [FIXTURE_DIR]")
        kind = words[1]
        folders = [Path(words[2])] if len(words) == 3 else default_fixture_dirs(kind)
        reports = [check(kind, folder) for folder in folders]
        for report in reports:
            print("\n".join(report.lines()))
        return 0 if all(r.ok for r in reports) else 1
    if len(words) != 3:
        raise SystemExit("usage: sa3mlx parity KIND FIXTURE_DIR OUT_DIR | sa3mlx parity check KIND [FIXTURE_DIR]")
    outputs = recompute(*words)
    for file, values in outputs.items():
        print(f"{Path(words[2]) / file}: {len(values)} keys")
    return 0


def _lora_validate(args) -> int:
    from sa3mlx.lora.validate import main as validate_main

    return validate_main([args.file])


def _lora_merge(args) -> int:
    from sa3mlx.lora.merge import MLX_MERGE_RULE, TORCH_SEMANTICS, merge_files

    rule = MLX_MERGE_RULE if args.mlx_strength_rule else TORCH_SEMANTICS
    merge_files(args.base, args.lora, args.out, rule, args.svd_dir)
    return 0


def _config(args) -> int:
    import json

    from sa3mlx.runtime.params import stage_params
    from sa3mlx.train.job import TrainJob

    params = stage_params(args.stage, args.root)
    model = params["model"]
    job = TrainJob.from_params(params["train"], base=model["base"], root=args.root, arc=model["arc"])
    print(json.dumps(job.resolved_config(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sa3mlx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="torch SA3/SAME/T5Gemma checkpoint -> MLX npz files")
    conv.add_argument("source", help="HF model folder (model_config.json + model.safetensors) or a checkpoint file")
    conv.add_argument("out_dir")
    conv.add_argument("--dit-dtype", default="float16", choices=("float16", "float32"))
    conv.add_argument("--same-dtype", default="float32", choices=("float16", "float32"))
    conv.add_argument("--t5gemma-dtype", default="float16", choices=("float16", "float32"))
    conv.add_argument(
        "--allow-pickle", action="store_true", help="read .ckpt/.pt files (runs pickle; needs torch; weights-only load)"
    )
    conv.add_argument(
        "--dit-only",
        action="store_true",
        help="a lone checkpoint file without model_config.json: write its DiT alone (no codec, no text encoder)",
    )
    conv.set_defaults(run=_convert)

    par = sub.add_parser(
        "parity",
        help="recompute / check golden fixtures of the official implementation",
        usage="sa3mlx parity KIND FIXTURE_DIR OUT_DIR | sa3mlx parity check KIND [FIXTURE_DIR]",
    )
    par.add_argument("words", nargs="+", metavar="ARG")
    par.set_defaults(run=_parity)

    config = sub.add_parser(
        "config", help="a stage's fully resolved configuration as JSON (preset + params + model config)"
    )
    config.add_argument("stage", choices=("train",))
    config.add_argument("--root", default=".", help="the project folder (params.yaml, dvc.yaml)")
    config.set_defaults(run=_config)

    lora = sub.add_parser("lora", help="adapter files").add_subparsers(dest="lora_command", required=True)
    val = lora.add_parser("validate", help="check an adapter file against underfit's upload contract")
    val.add_argument("file")
    val.set_defaults(run=_lora_validate)
    merge = lora.add_parser("merge", help="merge adapters into a converted dit.npz (loads like the base)")
    merge.add_argument("--base", required=True, help="converted DiT, e.g. models/converted/<base>/dit.npz")
    merge.add_argument(
        "--lora",
        required=True,
        action="append",
        metavar="FILE[:STRENGTH]",
        help="SA3 adapter .safetensors or PEFT folder, strength 1 by default; repeat to sum adapters",
    )
    merge.add_argument(
        "--svd-dir",
        help="svd stage output (models/svd/<base>) for -xs adapters; without it their bases are recomputed from --base",
    )
    merge.add_argument(
        "--mlx-strength-rule",
        action="store_true",
        help="official MLX merge rule W0 + s·(merged − W0) instead of torch's live semantics",
    )
    merge.add_argument("--out", required=True, help="merged .npz")
    merge.set_defaults(run=_lora_merge)
    return parser


def main(argv: list[str] | None = None) -> int:
    from sa3mlx.convert.checkpoint import CheckpointError
    from sa3mlx.lora.layers import LoRAShapeError
    from sa3mlx.models.config import ConfigError
    from sa3mlx.parity.registry import ParityError

    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointError, ConfigError, ParityError, FileNotFoundError, LoRAShapeError) as e:
        print(f"sa3mlx {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
