"""DVC stage `normalize`: data/raw/ (any audio) -> data/normalized/ (44.1 kHz stereo, tags, census)."""

import sys

import sa3mlx  # noqa: F401  (BLAS set-up first, as in every stage)
from sa3mlx.audio.census import summary
from sa3mlx.audio.normalize import Options, normalize_dir, stage_failure
from sa3mlx.runtime.params import stage_params

RAW, OUT = "data/raw", "data/normalized"


def main() -> int:
    sys.stdout.reconfigure(errors="backslashreplace")
    options = Options.from_params(stage_params("normalize")["normalize"])
    report = normalize_dir(RAW, OUT, options)
    print(summary(report, RAW, OUT))
    failure = stage_failure(report, options.strict)
    if failure:
        print(f"normalize: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
