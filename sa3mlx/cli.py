"""The `sa3mlx` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before anything imports mlx)
from sa3mlx.runtime.errors import UserError, guarded


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


def _export(args) -> int:
    from sa3mlx.runtime.layout import LATENTS_DIR, NORMALIZED_DIR
    from sa3mlx.runtime.shards import ENCODE_DETAILS, NORMALIZE_REPORT, export_tree

    folder, summary = {"latents": (LATENTS_DIR, ENCODE_DETAILS), "normalized": (NORMALIZED_DIR, NORMALIZE_REPORT)}[
        args.what
    ]
    source = args.source or folder
    count = export_tree(source, args.out_dir, summary)  # a damaged shard or index: an ArtifactError naming it
    print(f"{source} -> {args.out_dir}: {count} files")
    return 0


def _doctor(args) -> int:
    from sa3mlx.doctor import main as doctor_main

    return doctor_main()


def _config(args) -> int:
    import json

    from sa3mlx.runtime.params import stage_params
    from sa3mlx.train.job import TrainJob

    params = stage_params(args.stage, args.root)
    model = params["model"]
    job = TrainJob.from_params(params["train"], base=model["base"], root=args.root, arc=model["arc"])
    print(json.dumps(job.resolved_config(), indent=2))
    return 0


def _generate(args) -> int:
    from sa3mlx.sample.generate_files import GenerateJob, run_job

    job = GenerateJob(**{k: v for k, v in vars(args).items() if k not in ("command", "run")})
    run_job(job)
    return 0


def _default_model() -> str:
    """models/converted/<model.base of ./params.yaml>, else the embedded tiny base."""
    import yaml

    from sa3mlx.runtime.layout import PARAMS_FILE, converted_dir

    params = Path(PARAMS_FILE)
    base = (yaml.safe_load(params.read_text()) or {}).get("model", {}).get("base") if params.is_file() else None
    return str(converted_dir(base or "tiny-base"))


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="render a prompt (text, audio-to-audio, inpainting) with any adapters, as the official generate",
        description="Official StableAudioModel.generate semantics; see docs/generate.md for the quirks kept.",
    )
    gen.add_argument("prompt", help="text prompt ('' for unconditional)")
    gen.add_argument("--model", default=None, help="converted model folder (default models/converted/<model.base>)")
    gen.add_argument(
        "--lora", dest="adapters", action="append", default=[], metavar="FILE[:STRENGTH]", help="adapter (repeat)"
    )
    gen.add_argument("--seconds", type=float, default=30.0, help="seconds_total, and the output length")
    gen.add_argument("--steps", type=int, default=None, help="sampler steps (default 50 base, 8 ARC)")
    gen.add_argument("--cfg", type=float, default=None, help="guidance scale (default 7 base, 1 ARC)")
    gen.add_argument("--apg", type=float, default=1.0, help="APG scale with cfg != 1: 1 APG, 0 vanilla CFG")
    gen.add_argument("--negative-prompt", "--negative", dest="negative_prompt", default=None)
    gen.add_argument("--seed", type=int, default=None, help="default: random (printed and in the sidecar)")
    gen.add_argument("--init-audio", default=None, metavar="FILE", help="audio-to-audio source (any format)")
    gen.add_argument(
        "--init-noise-level", type=float, default=1.0, help="sigma_max with --init-audio (official default 1)"
    )
    gen.add_argument("--inpaint-audio", default=None, metavar="FILE", help="audio kept outside --inpaint-range")
    gen.add_argument(
        "--inpaint-range",
        dest="inpaint_ranges",
        action="append",
        default=[],
        metavar="START:END",
        help="seconds to regenerate (repeat)",
    )
    gen.add_argument(
        "--lora-interval-max", type=float, default=None, metavar="SIGMA", help="adapters off while sigma > SIGMA"
    )
    gen.add_argument(
        "--monotonic-schedule",
        action="store_true",
        help="fix: shift linspace(1, 0) and scale by sigma_max (official: the a2a schedule first rises)",
    )
    gen.add_argument("--svd-dir", default=None, help="svd stage output, for -xs adapters")
    gen.add_argument("--no-compile", dest="compile", action="store_false", help="do not mx.compile the DiT call")
    gen.add_argument("--out", default=None, metavar="FILE", help=".mp3 (default), .wav or .flac; sidecar FILE.json")
    gen.set_defaults(run=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sa3mlx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser(
        "doctor", help="check params.yaml, the model folders and data/raw before `dvc repro` (run in the project)"
    )
    doctor.set_defaults(run=_doctor)

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
    _add_generate(sub)

    export = sub.add_parser(
        "export", help="a stage's data folder (either layout) as plain files: the underfit npy + json tree"
    )
    export.add_argument("what", choices=("latents", "normalized"), help="encode's or normalize's output")
    export.add_argument("out_dir")
    export.add_argument("--from", dest="source", help="the folder to read (default data/latents or data/normalized)")
    export.set_defaults(run=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand: a user error is one `sa3mlx: <command>: <message>` line and status 2."""
    args = build_parser().parse_args(argv)
    if args.command == "generate" and args.model is None:
        args.model = _default_model()
    return guarded(args.command, lambda: _run_reporting_user_errors(args))


def _run_reporting_user_errors(args) -> int:
    from sa3mlx.parity.registry import ParityError

    try:
        return args.run(args)
    except FileNotFoundError as e:
        raise UserError(f"{e.filename or e}: no such file or folder") from e
    except ParityError as e:
        raise UserError(str(e)) from e


if __name__ == "__main__":
    sys.exit(main())
