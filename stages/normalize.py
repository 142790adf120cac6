"""DVC stage `normalize`: data/raw/ (any audio) -> data/normalized/ (44.1 kHz stereo, tags, census)."""

import sys

import sa3mlx  # noqa: F401  (BLAS set-up first, as in every stage)
from sa3mlx.audio.census import summary
from sa3mlx.audio.normalize import REPORT_NAME, Options, check_codec_rate, normalize_dir, stage_failure
from sa3mlx.runtime.errors import run_stage
from sa3mlx.runtime.layout import MODEL_CONFIG_FILE, NORMALIZED_DIR, RAW_DIR, source_model_dir
from sa3mlx.runtime.params import stage_params
from sa3mlx.runtime.previous import previous_output


def main() -> int:
    sys.stdout.reconfigure(errors="backslashreplace")
    params = stage_params("normalize")
    options = Options.from_params(params["normalize"])
    base = params["model"]["base"]
    check_codec_rate(options.sample_rate, source_model_dir(base) / MODEL_CONFIG_FILE, base)
    # DVC deleted the output before running us; the version dvc.lock records is in its cache
    report = normalize_dir(RAW_DIR, NORMALIZED_DIR, options, previous_output(NORMALIZED_DIR, REPORT_NAME), print)
    print(summary(report, RAW_DIR, NORMALIZED_DIR))
    failure = stage_failure(report, options.strict)
    if failure:
        print(f"normalize: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_stage("normalize", main)
