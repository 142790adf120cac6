"""`sa3mlx generate` around `sample.generate`: the model folder, input audio read as the normalize
stage reads it, the output file (MP3, WAV or FLAC by its suffix) and its JSON sidecar.

Input audio: any format libsndfile decodes, first two channels, resampled to the model rate with
soxr VHQ, mono doubled (as `normalize`). Output: the clip exactly as generate returns it
(clamped to [-1, 1], no peak normalisation) as MP3 (LAME V0, 16-bit PCM in), 32-bit float WAV or
24-bit FLAC; all three are byte-identical for the same seed and settings.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sa3mlx.audio.channels import reduce_channels, to_stereo
from sa3mlx.audio.decode import decode, open_input
from sa3mlx.audio.reasons import Rejected
from sa3mlx.audio.resample import resample
from sa3mlx.audio.write import write_flac24, write_float_wav
from sa3mlx.models.config import ModelConfig
from sa3mlx.runtime.io import save_json, sha256_file
from sa3mlx.runtime.layout import DIT_FILE, MODEL_CONFIG_FILE, SAME_DECODER_FILE, T5GEMMA_FILE
from sa3mlx.sample.audio_out import write_mp3
from sa3mlx.sample.demo_entries import AdapterRef
from sa3mlx.sample.demo_models import DemoModels
from sa3mlx.sample.generate import Generated, GenerateError, GenerateRequest, SeededDraws, generate

OUTPUT_SUFFIXES = (".mp3", ".wav", ".flac")
DEFAULT_OUT_DIR = "output"
_RANGE = re.compile(r"^\s*([0-9.eE+-]+)\s*[:,]\s*([0-9.eE+-]+)\s*$")


@dataclass
class GenerateJob:
    """Everything one `sa3mlx generate` call was asked for (paths as given)."""

    prompt: str
    model: str
    out: str | None = None
    adapters: list[str] = field(default_factory=list)  # FILE[:STRENGTH]
    seconds: float = 30.0
    steps: int | None = None
    cfg: float | None = None
    apg: float = 1.0
    negative_prompt: str | None = None
    seed: int | None = None
    init_audio: str | None = None
    init_noise_level: float = 1.0
    inpaint_audio: str | None = None
    inpaint_ranges: list[str] = field(default_factory=list)  # START:END
    lora_interval_max: float | None = None
    monotonic_schedule: bool = False
    svd_dir: str | None = None
    compile: bool = True


def model_folder(path: str | Path) -> Path:
    """A converted model folder, or a one-line error naming --model."""
    folder = Path(path)
    missing = [n for n in (MODEL_CONFIG_FILE, DIT_FILE, SAME_DECODER_FILE, T5GEMMA_FILE) if not (folder / n).is_file()]
    if not folder.is_dir() or missing:
        what = "does not exist" if not folder.is_dir() else f"is not a converted model folder (no {', '.join(missing)})"
        raise GenerateError(f"--model {folder}: {what}; convert one with `sa3mlx convert models/<name> {folder}`")
    return folder


def read_input_audio(path: str | Path, sample_rate: int, flag: str) -> np.ndarray:
    """An audio file -> [2, n] float32 at sample_rate, as the normalize stage reads and resamples it."""
    path = Path(path)
    if not path.is_file():
        raise GenerateError(f"{flag} {path}: no such file")
    try:
        with open_input(path) as (f, size):
            source = decode(f, size)
    except Rejected as e:
        raise GenerateError(f"{flag} {path}: unreadable audio ({e})") from None
    audio = resample(reduce_channels(source.audio), source.sample_rate, sample_rate)
    return np.ascontiguousarray(to_stereo(audio).T)


def optional_audio(path: str | None, sample_rate: int, flag: str) -> np.ndarray | None:
    return None if path is None else read_input_audio(path, sample_rate, flag)


def parse_range(text: str) -> tuple[float, float]:
    match = _RANGE.match(text)
    if not match:
        raise GenerateError(f"--inpaint-range {text!r}: expected START:END in seconds, e.g. 1.5:4")
    return float(match.group(1)), float(match.group(2))


def parse_adapter(text: str) -> AdapterRef:
    ref = AdapterRef.parse(text)
    if not ref.path.is_file():
        raise GenerateError(f"--lora {ref.path}: no such file")
    return ref


def output_path(job: GenerateJob, seed: int) -> Path:
    """--out, or output/<prompt words>_<seed>.mp3; the suffix picks the format."""
    if job.out is None:
        words = re.sub(r"[^a-z0-9]+", "_", job.prompt.lower()).strip("_")[:48] or "unconditional"
        return Path(DEFAULT_OUT_DIR) / f"{words}_{seed}.mp3"
    out = Path(job.out)
    if out.suffix.lower() not in OUTPUT_SUFFIXES:
        raise GenerateError(f"--out {out}: the suffix picks the format, one of {', '.join(OUTPUT_SUFFIXES)}")
    return out


def write_output(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """[C, n] float32 in [-1, 1] -> the file, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".mp3":
        pcm = np.round(np.clip(audio, -1.0, 1.0).astype(np.float64) * 32767.0).astype(np.int16).T.copy()
        write_mp3(path, pcm, sample_rate)
    elif suffix == ".wav":
        write_float_wav(path, audio.T, sample_rate)
    else:
        write_flac24(path, audio.T, sample_rate)


def input_record(path: str | None, **settings) -> dict | None:
    return None if path is None else {"path": str(path), "sha256": sha256_file(path), **settings}


def sidecar_record(job: GenerateJob, folder: Path, arc: bool, seed: int, result: Generated) -> dict:
    """Every setting of the call (resolved), what was read and what came out (no timings: the same
    call gives the same bytes)."""
    request, rate = result.request, ModelConfig.load(folder / MODEL_CONFIG_FILE).sample_rate
    return {
        "prompt": job.prompt,
        "negative_prompt": job.negative_prompt,
        "model": str(folder),
        "model_objective": "rf_denoiser" if arc else "rectified_flow",
        "sampler": "pingpong" if arc else "euler",
        "seconds": request.seconds,
        "steps": request.steps,
        "cfg": request.cfg,
        "apg": request.apg_scale,
        "seed": seed,
        "init_audio": input_record(job.init_audio, init_noise_level=request.init_noise_level),
        "inpaint_audio": input_record(job.inpaint_audio, ranges=[list(r) for r in request.inpaint_ranges]),
        "lora_interval_max": request.lora_interval_max,
        "monotonic_schedule": request.monotonic_schedule,
        "duration_padding_sec": request.padding_s,
        "adapters": [asdict(info) for info in result.adapters],
        "adapted_layers": result.adapted_layers,
        "adapters_applied": ("merged" if result.merged else "live") if result.adapters else None,
        "sigmas": [float(s) for s in np.asarray(result.sigmas).ravel()],
        "latents": result.size.latents,
        "sample_rate": rate,
        "samples": int(result.audio.shape[-1]),
    }


def run_job(job: GenerateJob, say=print) -> Path:
    """Load once, generate, write the audio and its sidecar; the output path."""
    folder = model_folder(job.model)
    config = ModelConfig.load(folder / MODEL_CONFIG_FILE)
    arc = config.objective == "rf_denoiser"
    seed = secrets.randbelow(2**31) if job.seed is None else job.seed
    out = output_path(job, seed)
    request = GenerateRequest(
        prompt=job.prompt,
        seconds=job.seconds,
        steps=job.steps,
        cfg=job.cfg,
        apg_scale=job.apg,
        negative_prompt=job.negative_prompt,
        init_audio=optional_audio(job.init_audio, config.sample_rate, "--init-audio"),
        init_noise_level=job.init_noise_level,
        inpaint_audio=optional_audio(job.inpaint_audio, config.sample_rate, "--inpaint-audio"),
        inpaint_ranges=tuple(parse_range(r) for r in job.inpaint_ranges),
        lora_interval_max=job.lora_interval_max,
        monotonic_schedule=job.monotonic_schedule,
        compile=job.compile,
    ).checked()
    adapters = [parse_adapter(a) for a in job.adapters]
    models = DemoModels(folder, folder if arc else None, svd_dir=job.svd_dir, say=say)
    start = time.perf_counter()
    result = generate(models, arc, request, adapters, SeededDraws(seed))
    wall = time.perf_counter() - start
    write_output(out, result.audio, config.sample_rate)
    save_json(out.with_suffix(".json"), sidecar_record(job, folder, arc, seed, result))
    for info in result.adapters:
        say(f"{info.path}: {info.adapter_type} rank {info.rank}, {info.layers} layers, strength {info.strength:g}")
    seconds = result.audio.shape[-1] / config.sample_rate
    if result.adapters:
        say(f"adapters: {result.adapted_layers} distinct layers adapted ({'merged' if result.merged else 'live'})")
    say(f"{out}: {seconds:.2f} s, seed {seed}, {result.request.steps} steps in {wall:.1f} s")
    return out
