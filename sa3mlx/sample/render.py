"""Render demos: prompt -> latents (base: Euler, ARC: ping-pong) -> SAME decode -> MP3 (+WAV),
sidecar JSON, mel spectrogram, and `index.html` over everything in the folder.

Schedules (underfit's): base demos shift linspace(1, 0) with the base model's *training* shift
(`distribution_shift_options`, "full" in SA3) at the demo's latent length; ARC demos use the
model's sampling shift (default LogSNR rate 0). Audio is rendered for seconds_total + 5 s,
trimmed there and peak-normalised to int16, as underfit writes it.

    summary = render_demos("demos", step, entries, DemoModels(base_dir, arc_dir), adapters)

Idempotent: a demo whose sidecar (written last) exists is not rendered again, and every file
is written atomically, so an interrupted call leaves only whole demos behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.models.conditioning import DiTInputs, text_to_audio_local
from sa3mlx.models.config import ModelConfig
from sa3mlx.models.same_chunked import decode_long
from sa3mlx.runtime.schema import check_section, field_specs, integer, number, spec
from sa3mlx.sample.audio_out import to_int16, write_mp3, write_sidecar, write_wav
from sa3mlx.sample.demo_entries import (
    TAIL_SECONDS,
    AdapterRef,
    DemoEntry,
    RenderSummary,
    demo_stem,
    kept_samples,
    latent_count,
    parse_entries,
)
from sa3mlx.sample.demo_models import DemoModels, Renderable
from sa3mlx.sample.pictures import write_spectrogram
from sa3mlx.sample.report import SPECTROGRAM_DIR, write_index
from sa3mlx.sample.samplers import GuidedVelocity, NoiseSource, sample_euler, sample_pingpong
from sa3mlx.sample.schedule import build_schedule
from sa3mlx.sample.shifts import SA3_SAMPLING_SHIFT, make_shift

Velocity = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class RenderOptions:
    tail_seconds: float = field(default=TAIL_SECONDS, metadata=spec(number(0)))  # rendered and kept past seconds_total
    wav: bool = False  # also write <stem>.wav (16-bit)
    decode_chunk: int = field(default=128, metadata=spec(integer(1)))  # SAME decode chunk (latents), as encode
    decode_overlap: int = field(default=32, metadata=spec(integer(0)))

    @classmethod
    def from_params(cls, params, section: str = "demo") -> RenderOptions:
        """The keys of `params` (a demo section) that are fields here, checked; the others are ignored."""
        specs = field_specs(cls)
        values = check_section(section, {key: params[key] for key in specs if key in params}, specs)
        return cls(**{key: float(v) if key == "tail_seconds" else v for key, v in values.items()})


# -- schedules ---------------------------------------------------------------------------------------
def base_schedule(steps: int, training_shift: dict | None, latents: int) -> np.ndarray:
    """underfit's base-demo schedule: the model's training shift (`distribution_shift_options`)
    over linspace(1, 0), with the demo's latent length as sequence length."""
    return build_schedule(steps, 1.0, shift=make_shift(training_shift), fallback_seq_len=latents)


def arc_schedule(steps: int, sampling_shift: dict | None, latents: int) -> np.ndarray:
    """The model's sampling shift (SA3 default: LogSNR rate 0, independent of the length)."""
    return build_schedule(steps, 1.0, shift=make_shift(sampling_shift) or SA3_SAMPLING_SHIFT, fallback_seq_len=latents)


def demo_schedule(entry: DemoEntry, config: ModelConfig, latents: int) -> np.ndarray:
    if entry.arc:
        return arc_schedule(entry.steps, config.sampling_distribution_shift, latents)
    return base_schedule(entry.steps, config.distribution_shift, latents)


# -- sampling ----------------------------------------------------------------------------------------
def interval_velocity(adapted: Velocity, plain: Velocity, interval_max: float | None) -> Velocity:
    """underfit's sigma-interval demo: the plain model while sigma > interval_max, adapted after."""
    if interval_max is None:
        return adapted

    def velocity(x: mx.array, t: mx.array) -> mx.array:
        return (adapted if float(t[0].item()) <= interval_max else plain)(x, t)

    return velocity


def live_velocity(renderable: Renderable, guided: GuidedVelocity, strength: float) -> Velocity:
    """The guided velocity with the live DiT adapters at `strength` (conditioner adapter untouched)."""

    def velocity(x: mx.array, t: mx.array) -> mx.array:
        renderable.live.set_strength(strength, dit_only=True)
        return guided(x, t)

    return velocity


def seeded_noise(key: mx.array, steps: int) -> NoiseSource:
    """Ping-pong step noise: draw i from the i-th split of `key` (reproducible per seed)."""
    keys = mx.random.split(key, max(steps, 2))
    return lambda i, shape, dtype: mx.random.normal(shape, dtype=dtype, key=keys[i])


def run_sampler(
    velocity: Velocity, x_init: mx.array, sigmas, sampler: str, step_noise: NoiseSource | None = None
) -> mx.array:
    """The demo sampler: Euler (base) or ping-pong with `step_noise` (ARC)."""
    if sampler == "euler":
        return sample_euler(velocity, x_init, sigmas)
    if sampler == "pingpong":
        return sample_pingpong(velocity, x_init, sigmas, step_noise)
    raise ValueError(f"unknown demo sampler '{sampler}' (euler, pingpong)")


def prompt_conditioning(
    models: DemoModels,
    renderable: Renderable,
    arc: bool,
    prompt: str,
    seconds: float,
    negative_prompt: str | None = None,
    cfg: float = 1.0,
    local: mx.array | None = None,
) -> tuple[DiTInputs, mx.array | None, mx.array | None]:
    """(inputs, negative tokens, negative mask) from the family's prompt encoder; the negative
    prompt is encoded only where guidance uses it (cfg != 1)."""
    cond = renderable.conditioner
    encoder = models.prompt_encoder(arc)
    hidden, mask = encoder([prompt])
    inputs = cond.assemble(hidden, mask, [seconds], local)
    if not negative_prompt or cfg == 1.0:
        return inputs, None, None
    neg_hidden, neg_mask = encoder([negative_prompt])
    negative = cond.assemble(neg_hidden, neg_mask, [seconds])
    return inputs, negative.cross_attn_cond, negative.cross_attn_mask


def conditioning(
    models: DemoModels, renderable: Renderable, entry: DemoEntry, latents: int
) -> tuple[DiTInputs, mx.array | None, mx.array | None]:
    """(inputs, negative tokens, negative mask) for one demo (text to audio: zero local conditioning)."""
    channels = renderable.dit.config.io_channels
    local = text_to_audio_local(1, channels, latents) if renderable.dit.config.local_add_cond_dim else None
    return prompt_conditioning(
        models, renderable, entry.arc, entry.prompt, entry.seconds, entry.negative_prompt, entry.cfg, local
    )


@dataclass(frozen=True)
class Guidance:
    """How the velocity of one render is guided (CFG scale, APG scale, negative tokens, sigma interval)."""

    cfg: float = 1.0
    apg_scale: float = 1.0
    negative: mx.array | None = None
    negative_mask: mx.array | None = None
    interval_max: float | None = None  # adapters off while sigma > this
    padding_mask: mx.array | None = None  # [B, T] True = real frames (None: every frame)


def guided_velocity(
    renderable: Renderable, plain: Renderable | None, inputs: DiTInputs, guidance: Guidance
) -> Velocity:
    """The render's velocity: `renderable`'s DiT guided, and with a sigma interval the plain
    model (live adapters at 0, or the `plain` DiT) while sigma > interval_max."""
    g = guidance

    def guided_by(dit) -> GuidedVelocity:
        return GuidedVelocity(dit, inputs, g.cfg, g.apg_scale, g.negative, g.negative_mask, padding_mask=g.padding_mask)

    guided = guided_by(renderable.dit)
    live = renderable.live
    if g.interval_max is not None and live is not None:
        adapted = live_velocity(renderable, guided, renderable.strength)
        return interval_velocity(adapted, live_velocity(renderable, guided, 0.0), g.interval_max)
    if g.interval_max is not None and plain is not None:
        return interval_velocity(guided, guided_by(plain.dit), g.interval_max)
    return guided


@contextmanager
def adapter_strength(renderable: Renderable):
    """Live adapters at the renderable's strength for the block, then back as found."""
    live = renderable.live
    found = {name: layer.strength for name, layer in live.layers.items()} if live is not None else {}
    if live is not None:
        live.set_strength(renderable.strength)  # DiT and conditioner, as set_lora_strength
    try:
        yield
    finally:
        for name, strength in found.items():  # back as found (a trainer's adapters: 1.0, as underfit)
            live.layers[name].strength = strength


def demo_latents(
    models: DemoModels, entry: DemoEntry, renderable: Renderable, latents: int, plain: Renderable | None = None
) -> mx.array:
    """Sample one demo's latents [1, C, latents] (seeded noise: baseline and adapter share it)."""
    config = models.config(entry.arc)
    with adapter_strength(renderable):
        inputs, negative, negative_mask = conditioning(models, renderable, entry, latents)
        interval = None if entry.arc else entry.lora_interval_max
        guidance = Guidance(entry.cfg, 1.0 if entry.apg else 0.0, negative, negative_mask, interval)
        velocity = guided_velocity(renderable, plain, inputs, guidance)
        init_key, step_key = mx.random.split(mx.random.key(entry.seed))
        x_init = mx.random.normal((1, renderable.dit.config.io_channels, latents), key=init_key)
        sigmas = demo_schedule(entry, config, latents)
        return run_sampler(velocity, x_init, sigmas, entry.sampler, seeded_noise(step_key, entry.steps))


def decode_audio(models: DemoModels, latents: mx.array, arc: bool, keep: int, options: RenderOptions) -> np.ndarray:
    """Latents -> [C, keep] float32 audio through the chunked SAME decoder (fp32)."""
    audio = decode_long(
        models.decoder(arc), np.array(latents.astype(mx.float32)), options.decode_chunk, options.decode_overlap
    )
    audio = np.array(audio[0])
    if audio.shape[-1] < keep:
        audio = np.pad(audio, ((0, 0), (0, keep - audio.shape[-1])))
    return audio[:, :keep]


def write_demo(
    out_dir: Path, stem: str, audio: np.ndarray, sample_rate: int, record: dict, options: RenderOptions
) -> None:
    """mp3 (+wav), spectrogram, then the sidecar, which marks the demo as complete."""
    pcm = to_int16(audio)
    write_mp3(out_dir / f"{stem}.mp3", pcm, sample_rate)
    if options.wav:
        write_wav(out_dir / f"{stem}.wav", pcm, sample_rate)
    write_spectrogram(out_dir / SPECTROGRAM_DIR / f"{stem}.png", pcm.T.astype(np.float32) / 32767.0, sample_rate)
    write_sidecar(out_dir / f"{stem}.json", record)


def is_done(out_dir: Path, stem: str) -> bool:
    return (out_dir / f"{stem}.json").is_file() and (out_dir / f"{stem}.mp3").is_file()


def render_one(
    out_dir: Path,
    stem: str,
    models: DemoModels,
    entry: DemoEntry,
    adapters: tuple[AdapterRef, ...],
    default: tuple[AdapterRef, ...],
    baseline: bool,
    options: RenderOptions,
) -> str | float:
    """Render one demo; its length in seconds, or a message when it cannot be rendered."""
    renderable = models.renderable(entry.arc, adapters, default, baseline)
    if isinstance(renderable, str):
        return renderable
    plain = None
    if entry.lora_interval_max is not None and not entry.arc and not baseline and renderable.live is None:
        plain = models.plain(False)
    config = models.config(entry.arc)
    decoder = models.decoder(entry.arc)
    count = latent_count(
        entry.seconds, config.sample_rate, decoder.samples_per_latent, decoder.latent_modulo, options.tail_seconds
    )
    latents = demo_latents(models, entry, renderable, count, plain)
    keep = kept_samples(entry.seconds, config.sample_rate, options.tail_seconds)
    audio = decode_audio(models, latents, entry.arc, keep, options)
    write_demo(out_dir, stem, audio, config.sample_rate, entry.sidecar(baseline), options)
    return keep / config.sample_rate


def render_demos(
    out_dir: str | Path,
    step: int,
    entries: Sequence,
    models: DemoModels,
    adapters: Sequence = (),
    *,
    baselines: bool = False,
    options: RenderOptions | None = None,
    release: bool = True,
    say: Callable[[str], None] = print,
) -> RenderSummary:
    """Render every entry at `step` into out_dir (`demo_<i>_<step:08d>.*`), plus, with
    `baselines`, each entry at strength 0 (`baseline_<i>.*`); then rewrite index.html.

    entries: DemoEntry or params dicts; adapters: the adapter files (AdapterRef, "FILE[:strength]"
    or paths) an entry renders with unless it lists its own; models: a DemoModels session (the
    trainer passes one holding its live adapted model). Demos already there are not rendered
    again. With `release`, the models loaded for this call are dropped at the end.
    """
    out_dir, options = Path(out_dir), options or RenderOptions()
    entries = parse_entries(entries)
    default = tuple(AdapterRef.parse(a) for a in adapters)
    summary, start = RenderSummary(), time.perf_counter()
    try:
        for index, entry in enumerate(entries):
            jobs = ([(demo_stem(index, None), True)] if baselines else []) + [(demo_stem(index, step), False)]
            for stem, baseline in jobs:
                if is_done(out_dir, stem):
                    summary.existing.append(stem)
                    continue
                result = render_one(
                    out_dir, stem, models, entry, entry.adapter_set(default), default, baseline, options
                )
                if isinstance(result, str):
                    summary.skipped[index] = result
                    say(f"demo {index} ({'ARC' if entry.arc else 'base'}) skipped: {result}")
                    continue
                summary.rendered.append(stem)
                summary.seconds_of_audio += result
                say(
                    f"demo {index} ({'ARC' if entry.arc else 'base'}{', baseline' if baseline else ''}): "
                    f"{stem}.mp3, {result:.1f} s"
                )
    finally:
        if release:
            models.release()
    write_index(out_dir, entries, summary.skipped, [Path(a.path).name for a in default])
    summary.wall_seconds = time.perf_counter() - start
    return summary
