"""Demo render speed at small-music dims (random weights): seconds of audio per wall second for
an 8-step ARC demo (ping-pong, cfg 1) and a 50-step base demo (Euler, cfg 7 APG), measured in one run.

    python bench/demo.py [--seconds 10] [--depth N] [--base-steps 50] [--arc-steps 8] [--demos arc base]

Each demo renders `seconds` of audio (latents for exactly that length): sampling with the SA3
small DiT (`bench/dit.py` sizes; 256 prompt tokens + the seconds token, random conditioning,
no text encoder), chunked SAME-S decode (`bench/same.py` config), then peak-normalised MP3 and
mel spectrogram. Prints the wall time of each part and the x-real-time ratio of the whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from dit import PROMPT_TOKENS, SIZES  # bench/dit.py: the official DiT sizes
from same import SAME_S, randomize  # bench/same.py: the SAME-S codec config, random init

from sa3mlx.models.conditioning import DiTInputs
from sa3mlx.models.config import AutoencoderConfig
from sa3mlx.models.dit import DiT
from sa3mlx.models.same import SameDecoder
from sa3mlx.models.same_chunked import decode_long
from sa3mlx.sample.audio_out import to_int16, write_mp3
from sa3mlx.sample.pictures import write_spectrogram
from sa3mlx.sample.render import arc_schedule, base_schedule, run_sampler, seeded_noise
from sa3mlx.sample.samplers import GuidedVelocity

SAMPLE_RATE = 44100
TRAINING_SHIFT = {"type": "full", "min_length": 256, "max_length": 4096}  # shipped SA3 configs


def render(dit: DiT, decoder: SameDecoder, latents: int, steps: int, arc: bool, out: Path) -> dict:
    """One demo; wall seconds of sampling, decoding and writing."""
    key = mx.random.key(0)
    cfg = dit.config
    inputs = DiTInputs(
        mx.random.normal((1, PROMPT_TOKENS, cfg.cond_token_dim), key=key),
        mx.random.normal((1, cfg.global_cond_dim), key=key),
        mx.zeros((1, cfg.local_add_cond_dim, latents)),
    )
    velocity = GuidedVelocity(dit, inputs, cfg_scale=1.0 if arc else 7.0)
    x = mx.random.normal((1, cfg.io_channels, latents), key=key)
    times = {}
    start = time.perf_counter()
    if arc:
        sigmas = arc_schedule(steps, None, latents)
        result = run_sampler(velocity, x, sigmas, "pingpong", seeded_noise(key, steps))
    else:
        result = run_sampler(velocity, x, base_schedule(steps, TRAINING_SHIFT, latents), "euler")
    mx.eval(result)
    times["sample"] = time.perf_counter() - start
    start = time.perf_counter()
    audio = np.array(decode_long(decoder, np.array(result), 128, 32)[0])
    times["decode"] = time.perf_counter() - start
    start = time.perf_counter()
    write_mp3(out / "demo.mp3", to_int16(audio), SAMPLE_RATE)
    write_spectrogram(out / "demo.png", audio, SAMPLE_RATE)
    times["write"] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--depth", type=int, help="override the DiT depth (fewer blocks, same shapes)")
    parser.add_argument("--base-steps", type=int, default=50)
    parser.add_argument("--arc-steps", type=int, default=8)
    parser.add_argument("--demos", nargs="+", choices=["arc", "base"], default=["arc", "base"])
    args = parser.parse_args()

    cfg = SIZES["small"] if args.depth is None else dataclasses.replace(SIZES["small"], depth=args.depth)
    mx.random.seed(0)
    dit = DiT(cfg)
    mx.eval(dit.parameters())
    decoder = SameDecoder(AutoencoderConfig.from_dict(SAME_S))
    randomize(decoder)
    latents = -(-round(args.seconds * SAMPLE_RATE) // 4096)
    latents += latents % 2  # SAME-S latent modulo
    audio_seconds = latents * 4096 / SAMPLE_RATE
    print(
        f"small-music DiT depth {cfg.depth}, SAME-S decoder, random weights; {latents} latents "
        f"= {audio_seconds:.1f} s of audio per demo; device {mx.default_device()}"
    )
    print(f"{'demo':<22}{'sample s':>10}{'decode s':>10}{'write s':>9}{'total s':>9}{'x realtime':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        render(dit, decoder, latents, 1, True, Path(tmp))  # warm-up
        demos = {
            "arc": (f"ARC {args.arc_steps} steps cfg 1", args.arc_steps, True),
            "base": (f"base {args.base_steps} steps cfg 7", args.base_steps, False),
        }
        for name, steps, arc in (demos[d] for d in args.demos):
            times = render(dit, decoder, latents, steps, arc, Path(tmp))
            total = sum(times.values())
            print(
                f"{name:<22}{times['sample']:10.2f}{times['decode']:10.2f}{times['write']:9.2f}"
                f"{total:9.2f}{audio_seconds / total:12.3f}"
            )


if __name__ == "__main__":
    main()
