"""DVC stage `encode`: data/normalized/ -> data/latents/ (SAME latents + sidecars), incremental.

    python stages/encode.py [--shard i/n]

`--shard` overrides `encode.shard` so several processes (or hosts sharing data/encode_cache)
can split a corpus; a final unsharded run then assembles data/latents/ from the cache.
"""

import argparse
import sys

import sa3mlx  # noqa: F401  (BLAS set-up first, as in every stage)
from sa3mlx.data.encode import DETAILS_FILE, Codec, EncodeOptions, encode_dir
from sa3mlx.runtime.errors import USER_ERROR_STATUS, run_stage
from sa3mlx.runtime.layout import ENCODE_CACHE_DIR as CACHE
from sa3mlx.runtime.layout import LATENTS_DIR as LATENTS
from sa3mlx.runtime.layout import NORMALIZED_DIR as NORMALIZED
from sa3mlx.runtime.params import stage_params
from sa3mlx.runtime.previous import previous_output


def main() -> int:
    sys.stdout.reconfigure(errors="backslashreplace", line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shard", help="i/n: encode only this share of the files")
    args = parser.parse_args()
    params = stage_params("encode")
    settings = dict(params["encode"])
    if args.shard is not None:
        settings["shard"] = args.shard
    options = EncodeOptions.from_params(settings)
    model = params["model"]["base"]
    codec = Codec.open(f"models/converted/{model}")
    share = f", shard {options.shard}" if options.shard else ""
    print(
        f"encode: {NORMALIZED} -> {LATENTS} with the SAME encoder of {model} (fp32; chunks of "
        f"{options.chunk_latents} latents, overlap {options.overlap}, above {options.chunk_above_seconds:g} s; "
        f"cache {CACHE}{share})"
    )
    previous = previous_output(LATENTS, DETAILS_FILE)  # DVC deleted the output; dvc.lock's version is in its cache
    summary = encode_dir(NORMALIZED, LATENTS, CACHE, codec, options, model, previous=previous)
    print(f"encode: {summary.total - len(summary.errors)} files, {summary.seconds_total:.1f} s of audio in {LATENTS}")
    if options.shard:
        print("encode: one shard only; an unsharded run assembles all latents from the cache")
    for error in summary.errors:  # a user error's message names its file and the fix
        text = error["error"] if error.get("user") else f"{error['path']}: {error['error']}"
        print(f"sa3mlx: encode: {text}", file=sys.stderr)
    print(summary.line())
    if not summary.errors:
        return 0
    return USER_ERROR_STATUS if all(error.get("user") for error in summary.errors) else 1


if __name__ == "__main__":
    run_stage("encode", main)
