"""`sa3mlx generate` speed at small-music dims (random weights): real-time factor of the whole
`sample.generate` call (prompt encoding, sampling, SAME-S decode with the official eval noise) for
a 50-step cfg-7 base render and an 8-step ARC render, at 10 s and 60 s, measured in one run.

    python bench/generate.py [--seconds 10 60] [--renders base arc] [--depth N] [--repeats 1] [--no-compile]

The models are the SA3 small DiT (`bench/dit.py` sizes) and SAME-S codec (`bench/same.py`) with
random weights behind the demo renderer's `DemoModels` interface, and the tiny embedded T5Gemma as
prompt encoder (its cost is negligible at any size next to 8-50 DiT steps). RTF = wall seconds per
second of audio (< 1: faster than real time); x_realtime = its inverse. With `--compare-compile`
each render is also timed without `mx.compile` (same numbers: the check prints their max |delta|).
The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before mlx: first)

# isort: split
import mlx.core as mx
import numpy as np
from dit import SIZES  # bench/dit.py: the official DiT sizes
from same import SAME_S, randomize  # bench/same.py: the SAME-S codec config, random init

from sa3mlx.convert.model import convert_source
from sa3mlx.models.conditioning import Conditioner
from sa3mlx.models.config import AutoencoderConfig, ModelConfig
from sa3mlx.models.dit import DiT
from sa3mlx.models.same import SameDecoder, SameEncoder
from sa3mlx.runtime.layout import MODEL_CONFIG_FILE
from sa3mlx.sample.demo_models import DemoModels, Renderable
from sa3mlx.sample.generate import GenerateRequest, SeededDraws, generate

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "house drums loop with four on the floor kick and hihat at 124 bpm"
RENDERS = {"base": {"steps": 50, "cfg": 7.0}, "arc": {"steps": 8, "cfg": 1.0}}
DEFAULT_STEPS = {name: render["steps"] for name, render in RENDERS.items()}


class TimedDecoder:
    """The decoder, its wall time (evaluated) appended to `seconds` per call."""

    def __init__(self, decoder: SameDecoder, seconds: list[float]):
        self.decoder, self.seconds = decoder, seconds
        self.cfg, self.latent_modulo = decoder.cfg, decoder.latent_modulo
        self.samples_per_latent = decoder.samples_per_latent

    def __call__(self, *args):
        start = time.perf_counter()
        audio = self.decoder(*args)
        mx.eval(audio)
        self.seconds.append(time.perf_counter() - start)
        return audio


class RandomSmallModels(DemoModels):
    """DemoModels over in-memory random small-music modules (the tiny folder gives the text encoder)."""

    def __init__(self, tiny_folder: Path, depth: int | None):
        super().__init__(tiny_folder, tiny_folder, say=lambda _: None)
        dit_cfg = SIZES["small"] if depth is None else dataclasses.replace(SIZES["small"], depth=depth)
        codec = AutoencoderConfig.from_dict(SAME_S)
        tiny = ModelConfig.load(tiny_folder / MODEL_CONFIG_FILE)
        self.base_config = dataclasses.replace(tiny, dit=dit_cfg, autoencoder=codec, objective="rectified_flow")
        self.arc_config = dataclasses.replace(self.base_config, objective="rf_denoiser")
        mx.random.seed(0)
        self.dit = DiT(dit_cfg)
        mx.eval(self.dit.parameters())
        self.conditioner = Conditioner.from_config(tiny.conditioner)
        self.codec = codec
        self.same_encoder = SameEncoder(codec)
        randomize(self.same_encoder)
        noise = {"mask_noise": codec.decoder.mask_noise or 0.01, "noise_regularize": True}  # the official eval noise
        self.same_decoder = SameDecoder(codec, **noise)
        randomize(self.same_decoder)
        self.decode_seconds: list[float] = []

    def renderable(self, arc, adapters, default, baseline):
        return Renderable(self.dit, self.conditioner)

    def plain(self, arc):
        return Renderable(self.dit, self.conditioner)

    def decoder(self, arc=False, official_noise=False):
        return TimedDecoder(self.same_decoder, self.decode_seconds)

    def encoder(self, arc=False):
        return self.same_encoder


def timed_render(
    models: RandomSmallModels, name: str, seconds: float, compile_dit: bool
) -> tuple[float, float, np.ndarray]:
    """(wall seconds, of which decoding, audio) of one generate call."""
    request = GenerateRequest(PROMPT, seconds=seconds, compile=compile_dit, **RENDERS[name])
    start = time.perf_counter()
    result = generate(models, name == "arc", request, (), SeededDraws(0))
    return time.perf_counter() - start, models.decode_seconds[-1], result.audio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[10.0, 60.0])
    parser.add_argument("--renders", nargs="+", choices=list(RENDERS), default=list(RENDERS))
    parser.add_argument("--depth", type=int, help="override the DiT depth (fewer blocks, same shapes)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--base-steps", type=int, help="override the base render's 50 steps")
    parser.add_argument("--compare-compile", action="store_true", help="also time each render uncompiled")
    args = parser.parse_args()
    if args.base_steps:
        RENDERS["base"]["steps"] = args.base_steps

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        convert_source(ROOT / "models" / "tiny-base", Path(tmp) / "tiny")
        models = RandomSmallModels(Path(tmp) / "tiny", args.depth)
        depth = models.dit.config.depth
        print(
            f"small-music DiT depth {depth}, SAME-S codec, random weights; MLX {mx.__version__} {mx.default_device()}"
        )
        timed_render(models, "arc", 1.0, True)  # warm-up (kernels, text encoder)
        print(f"{'render':<26}{'seconds':>8}{'wall s (min/med/max)':>24}{'decode s':>9}{'RTF':>8}{'x real':>8}")
        for seconds in args.seconds:
            for name in args.renders:
                modes = [True, False] if args.compare_compile else [True]
                for compiled in modes:
                    runs = [timed_render(models, name, seconds, compiled) for _ in range(args.repeats)]
                    walls, decodes, audios = zip(*runs)
                    rtf = float(np.median(walls)) / seconds
                    steps, wall, decode = RENDERS[name]["steps"], float(np.median(walls)), float(np.median(decodes))
                    wanted = DEFAULT_STEPS[name]
                    label = f"{name} {RENDERS[name]['steps']} steps cfg {RENDERS[name]['cfg']:g}" + (
                        "" if compiled else " (eager)"
                    )
                    rows.append(
                        {
                            "render": name,
                            "steps": RENDERS[name]["steps"],
                            "cfg": RENDERS[name]["cfg"],
                            "seconds": seconds,
                            "compiled": compiled,
                            "wall_s": [round(w, 3) for w in (min(walls), float(np.median(walls)), max(walls))],
                            "rtf": round(rtf, 4),
                            "x_realtime": round(1 / rtf, 4),
                            "decode_s": round(decode, 3),
                            # steps scaled to the render's default count (only differs with --base-steps)
                            f"rtf_at_{wanted}_steps": round((decode + (wall - decode) * wanted / steps) / seconds, 4),
                            "audio": audios[0],
                        }
                    )
                    print(
                        f"{label:<26}{seconds:8.0f}{min(walls):8.2f}{wall:8.2f}{max(walls):8.2f}{decode:9.2f}"
                        f"{rtf:8.3f}{1 / rtf:8.3f}"
                    )
                if args.compare_compile:
                    eager, fast = rows[-1], rows[-2]
                    delta = float(np.max(np.abs(eager["audio"] - fast["audio"])))
                    speedup = eager["rtf"] / fast["rtf"]
                    print(f"  compiled vs eager: max |delta audio| {delta:.3g}, speed-up {speedup:.2f}x")
    for row in rows:
        del row["audio"]
    print("RESULT " + json.dumps({"depth": depth, "device": str(mx.default_device()), "rows": rows}))


if __name__ == "__main__":
    main()
