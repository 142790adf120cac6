"""DVC stage `demo`: render the trained adapter into demos/ — every `demo.entries` entry on the
base model (Euler, adapter live) or the ARC model (ping-pong, adapter merged), each beside its
baseline at strength 0 — as MP3 + underfit sidecar JSON + mel spectrogram, and demos/index.html.

    python stages/demo.py [ADAPTER]
"""

import argparse
import sys
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up first, as in every stage)
from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.runtime.errors import UserError, run_stage
from sa3mlx.runtime.params import stage_params
from sa3mlx.runtime.schema import flag
from sa3mlx.sample.demo_entries import checked_entries
from sa3mlx.sample.demo_models import DemoModels
from sa3mlx.sample.render import RenderOptions, render_demos

OUT = "demos"


def adapter_file(path: str) -> Path:
    """The adapter to render: a .safetensors file, or a folder holding exactly one."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if len(found) != 1:
        listed = ", ".join(p.name for p in found) or "none"
        raise UserError(f"{path} must be an adapter file or a folder with one .safetensors (found {listed})")
    return found[0]


def main() -> int:
    sys.stdout.reconfigure(errors="backslashreplace", line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "adapter",
        nargs="?",
        default="models/lora",
        help="the trained adapter (dvc.yaml passes train's output); default: the one in models/lora",
    )
    args = parser.parse_args()
    declared = stage_params("demo")
    params, model = declared["demo"], declared["model"]
    adapter = adapter_file(args.adapter)
    step = int(read_lora(adapter).config.get("step") or 0)
    entries = checked_entries("demo.entries", params["entries"], params.get("defaults"))
    base, arc = f"models/converted/{model['base']}", f"models/converted/{model['arc']}"
    print(
        f"demo: {len(entries)} entries, adapter {adapter} (step {step}) on {model['base']} (base) and "
        f"{model['arc']} (ARC) -> {OUT}/"
    )
    models = DemoModels(base, arc, svd_dir=f"models/svd/{model['base']}")
    summary = render_demos(
        OUT,
        step,
        entries,
        models,
        [adapter],
        baselines=flag().check("demo.baselines", params.get("baselines", True)),
        options=RenderOptions.from_params(params),
    )
    print(summary.line())
    return 0


if __name__ == "__main__":
    run_stage("demo", main)
