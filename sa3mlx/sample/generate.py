"""One generation with the official `StableAudioModel.generate` semantics: text to audio,
audio to audio (init audio encoded by SAME, mixed with noise at sigma_max = init_noise_level)
and inpainting (kept ranges as local conditioning), on a base model (Euler) or an ARC model
(ping-pong), with any set of adapters — through the demo renderer's models and velocity.

    models = DemoModels(folder)                              # or DemoModels(base, arc)
    result = generate(models, arc, GenerateRequest("warm pad", seconds=10), adapters, SeededDraws(0))

Lengths, masks and the schedule are `generation.py`'s (official quirks included). Every random
draw comes from `draws` (`SeededDraws`: MLX keys from one seed, so the same seed gives the same
bytes; `ReplayedDraws`: stored draws, for parity), the codec's eval-mode decode noise included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.models.conditioning import local_conditioning, text_to_audio_local
from sa3mlx.models.config import ModelConfig
from sa3mlx.runtime.errors import UserError
from sa3mlx.runtime.io import sha256_file
from sa3mlx.runtime.layout import MODEL_CONFIG_FILE
from sa3mlx.sample import generation
from sa3mlx.sample.demo_entries import ARC_DEFAULTS, BASE_DEFAULTS, AdapterRef
from sa3mlx.sample.demo_models import ADAPTER_ERRORS, DemoModels, Renderable
from sa3mlx.sample.render import Guidance, adapter_strength, guided_velocity, prompt_conditioning, run_sampler
from sa3mlx.sample.samplers import NoiseSource, fixed_noise, noised_init, random_noise
from sa3mlx.sample.shifts import SA3_SAMPLING_SHIFT, make_shift

MIN_NOISE_LEVEL = 0.01  # below this the model is evaluated at t ~ 0, where it is undefined


class GenerateError(UserError, ValueError):
    """A request that cannot be generated; the message names the flag or file."""


@dataclass(frozen=True, eq=False)
class GenerateRequest:
    prompt: str
    seconds: float = 30.0
    steps: int | None = None  # None: 50 base, 8 ARC (the demo defaults)
    cfg: float | None = None  # None: 7 base, 1 ARC
    apg_scale: float = 1.0  # 1 = APG, 0 = vanilla CFG, between: blended
    negative_prompt: str | None = None
    init_audio: np.ndarray | None = None  # [C, n] float32 at the model rate
    init_noise_level: float = 1.0  # sigma_max with init audio (official default 1: the init is drowned)
    inpaint_audio: np.ndarray | None = None  # [C, n] float32 at the model rate
    inpaint_ranges: tuple[tuple[float, float], ...] = ()  # seconds regenerated; the rest is kept
    lora_interval_max: float | None = None  # adapters off while sigma > this, on after
    monotonic_schedule: bool = False  # the fix of the rising a2a schedule (off: official)
    padding_s: float = generation.DURATION_PADDING_S
    sample_size: int = generation.MAX_SAMPLE_SIZE
    compile: bool = True  # mx.compile the DiT call (not with live adapters, whose strength changes)

    def resolved(self, arc: bool) -> GenerateRequest:
        family = ARC_DEFAULTS if arc else BASE_DEFAULTS
        steps = family["steps"] if self.steps is None else self.steps
        cfg = family["cfg"] if self.cfg is None else self.cfg
        return replace(self, steps=steps, cfg=cfg).checked()

    def checked(self) -> GenerateRequest:
        if self.seconds <= 0:
            raise GenerateError(f"--seconds must be > 0, got {self.seconds:g}")
        if self.steps is not None and self.steps < 1:
            raise GenerateError(f"--steps must be >= 1, got {self.steps}")
        if self.init_audio is not None and not self.init_noise_level >= MIN_NOISE_LEVEL:
            raise GenerateError(f"--init-noise-level must be >= {MIN_NOISE_LEVEL}, got {self.init_noise_level:g}")
        if self.inpaint_ranges and self.inpaint_audio is None:
            raise GenerateError("--inpaint-range needs --inpaint-audio (the audio whose other parts are kept)")
        if self.inpaint_audio is not None and not self.inpaint_ranges:
            raise GenerateError("--inpaint-audio needs an --inpaint-range START:END (without one nothing is kept)")
        for start, end in self.inpaint_ranges:
            if not 0 <= start < end <= self.seconds:
                raise GenerateError(
                    f"--inpaint-range {start:g}:{end:g} is outside the clip: need 0 <= START < END <= "
                    f"--seconds ({self.seconds:g})"
                )
        if self.lora_interval_max is not None and not 0 <= self.lora_interval_max <= 1:
            raise GenerateError(f"--lora-interval-max must be in [0, 1], got {self.lora_interval_max:g}")
        return self


# -- random draws -------------------------------------------------------------------------------------
class SeededDraws:
    """Every draw of one call from one seed: a fixed MLX key per draw site, so the draws do not
    depend on each other's order or on anything else using the global generator."""

    def __init__(self, seed: int):
        self.seed = seed
        self._keys = dict(zip(("initial", "steps", "bottleneck", "tokens"), mx.random.split(mx.random.key(seed), 4)))

    def _normal(self, site: str, shape: tuple) -> mx.array:
        return mx.random.normal(shape, key=self._keys[site])

    def initial(self, shape: tuple) -> mx.array:
        return self._normal("initial", shape)

    def steps(self) -> NoiseSource:
        return random_noise(self._keys["steps"])

    def bottleneck(self, shape: tuple) -> mx.array:
        return self._normal("bottleneck", shape)

    def tokens(self, shape: tuple) -> mx.array:
        return self._normal("tokens", shape)


@dataclass
class ReplayedDraws:
    """Stored draws (e.g. the official run's) in place of SeededDraws'."""

    noise: np.ndarray
    bottleneck_noise: np.ndarray
    decoder_mask_noise: np.ndarray
    pingpong_noise: np.ndarray | None = None

    def initial(self, shape: tuple) -> mx.array:
        return _checked_draw(self.noise, shape, "noise")

    def steps(self) -> NoiseSource | None:
        return None if self.pingpong_noise is None else fixed_noise(self.pingpong_noise)

    def bottleneck(self, shape: tuple) -> mx.array:
        return _checked_draw(self.bottleneck_noise, shape, "bottleneck_noise")

    def tokens(self, shape: tuple) -> mx.array:
        return _checked_draw(self.decoder_mask_noise, shape, "decoder_mask_noise")


def _checked_draw(value: np.ndarray, shape: tuple, name: str) -> mx.array:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"stored draw {name} has shape {tuple(value.shape)}, the call draws {tuple(shape)}")
    return mx.array(value)


# -- the model's pieces --------------------------------------------------------------------------------
@dataclass
class AdapterInfo:
    path: str
    strength: float
    sha256: str
    adapter_type: str
    rank: int
    layers: int


def adapter_infos(adapters: Sequence[AdapterRef]) -> tuple[list[AdapterInfo], int]:
    """What each adapter is (for the sidecar) and how many distinct layers they adapt together;
    an adapter holding no layer is an error."""
    infos, names = [], set()
    for ref in adapters:
        try:
            lora = read_lora(ref.path)
        except ADAPTER_ERRORS as e:
            raise GenerateError(f"--lora {ref.path}: {e}") from None
        if not lora.layers:
            raise GenerateError(f"--lora {ref.path}: the adapter holds no layer")
        kind, rank = lora.config["adapter_type"], lora.config["rank"]
        infos.append(AdapterInfo(str(ref.path), ref.strength, sha256_file(ref.path), kind, rank, len(lora.layers)))
        names.update(lora.layers)
    return infos, len(names)


def model_for(models: DemoModels, arc: bool, adapters: tuple[AdapterRef, ...]) -> Renderable:
    """The demo renderer's model: a base adapter alone live, several merged, ARC merged."""
    try:
        renderable = models.renderable(arc, adapters, adapters, False)
    except ADAPTER_ERRORS as e:
        raise GenerateError(f"--lora: {e}") from None
    if isinstance(renderable, str):
        raise GenerateError(f"--lora: {renderable}")
    return renderable


class CompiledDiT:
    """The DiT call `mx.compile`d (weights are compile inputs), one graph per set of optional inputs."""

    def __init__(self, dit):
        self.dit, self.config, self._graphs = dit, dit.config, {}

    def __call__(self, x, t, cross, global_cond, local=None, padding_mask=None) -> mx.array:
        optional = {"local_add_cond": local, "padding_mask": padding_mask}
        given = tuple(name for name, value in optional.items() if value is not None)
        if given not in self._graphs:
            self._graphs[given] = mx.compile(
                lambda x, t, c, g, *extra: self.dit(x, t, c, g, **dict(zip(given, extra))), inputs=self.dit.state
            )
        return self._graphs[given](x, t, cross, global_cond, *(optional[name] for name in given))


def compiled(renderable: Renderable | None) -> Renderable | None:
    """A merged or plain model with its DiT call compiled (live adapters change strength: not compiled)."""
    if renderable is None or renderable.live is not None:
        return renderable
    return Renderable(CompiledDiT(renderable.dit), renderable.conditioner)


def encode_audio(models: DemoModels, arc: bool, audio: np.ndarray, size: generation.Lengths) -> mx.array:
    """[C, n] -> latents [1, C_lat, T]: padded or cut to N samples at the end, encoded unchunked."""
    fitted = generation.fit_audio(np.asarray(audio, np.float32), size.samples)
    latents = models.encoder(arc)(mx.array(fitted[None]))
    mx.eval(latents)
    return latents


def decode_audio(models: DemoModels, arc: bool, latents: mx.array, draws, size: generation.Lengths) -> np.ndarray:
    """Final latents -> [C, int(seconds·rate)] float32 audio, as the official decode returns it."""
    decoder = models.decoder(arc, official_noise=True)
    cfg = decoder.cfg.decoder
    frames = -(-latents.shape[-1] // decoder.latent_modulo) * decoder.latent_modulo
    tokens = draws.tokens((latents.shape[0] * frames, cfg.stride, cfg.width))
    audio = decoder(latents, draws.bottleneck(tuple(latents.shape)), tokens)
    return generation.finish_audio(np.array(audio), size, decoder.samples_per_latent)[0]


# -- one call ------------------------------------------------------------------------------------------
@dataclass
class Generated:
    audio: np.ndarray  # [C, int(seconds·rate)] float32 in [-1, 1]
    latents: mx.array  # [1, C, T] final latents
    size: generation.Lengths
    sigmas: np.ndarray  # [1, steps+1]
    request: GenerateRequest  # resolved (steps, cfg filled)
    adapters: list[AdapterInfo] = field(default_factory=list)
    adapted_layers: int = 0  # distinct layers the adapters change (each one must fit the model)
    merged: bool = False  # adapters merged into the weights (else applied live, or none)


def local_inputs(
    models: DemoModels, arc: bool, request: GenerateRequest, size: generation.Lengths, trace: dict
) -> mx.array:
    """local_add_cond [1, C+1, T]: cat(mask, inpaint_latents·mask); all zeros without inpaint audio."""
    channels = models.config(arc).dit.io_channels
    if request.inpaint_audio is None:
        return text_to_audio_local(1, channels, size.latents)
    rate = models.config(arc).sample_rate
    latents = encode_audio(models, arc, request.inpaint_audio, size)
    mask = generation.inpaint_mask(list(request.inpaint_ranges), request.seconds, size, rate)
    trace.update(inpaint_latents=latents, inpaint_mask=mask)
    return local_conditioning(mx.array(mask), latents)


def sampling_shift(models: DemoModels, arc: bool):
    return make_shift(models.config(arc).sampling_distribution_shift) or SA3_SAMPLING_SHIFT


def sample_latents(
    models: DemoModels,
    arc: bool,
    request: GenerateRequest,
    renderable: Renderable,
    draws,
    trace: dict,
) -> tuple[mx.array, generation.Lengths, np.ndarray]:
    """(final latents, lengths, sigmas) of one resolved request on `renderable`."""
    config = models.config(arc)
    codec = config.autoencoder.encoder
    size = generation.lengths(
        request.seconds,
        config.sample_rate,
        config.autoencoder.downsampling_ratio,
        codec.chunk_size // codec.stride,
        request.padding_s,
        request.sample_size,
    )
    noise = draws.initial((1, config.dit.io_channels, size.latents))
    local = local_inputs(models, arc, request, size, trace) if config.dit.local_add_cond_dim else None
    if local is None and request.inpaint_audio is not None:
        raise GenerateError(f"--inpaint-audio: the model {models.folder(arc)} has no inpainting input")
    padding = mx.array(generation.padding_mask(size))
    plain = models.plain(arc) if request.lora_interval_max is not None and renderable.live is None else None
    with adapter_strength(renderable):
        inputs, negative, negative_mask = prompt_conditioning(
            models, renderable, arc, request.prompt, request.seconds, request.negative_prompt, request.cfg, local
        )
        guidance = Guidance(request.cfg, request.apg_scale, negative, negative_mask, request.lora_interval_max, padding)
        if request.compile:
            renderable, plain = compiled(renderable), compiled(plain)
        velocity = traced(guided_velocity(renderable, plain, inputs, guidance), trace)
        sigma_max = request.init_noise_level if request.init_audio is not None else 1.0
        sigmas = generation.schedule(
            request.steps, sigma_max, sampling_shift(models, arc), size, request.monotonic_schedule
        )
        x = noise
        if request.init_audio is not None:
            init_latents = encode_audio(models, arc, request.init_audio, size)
            x = noised_init(init_latents, noise, sigma_max)
            trace.update(init_latents=init_latents)
        trace.update(inputs=inputs, padding_mask=padding, sigmas=sigmas, x_start=x, local_add_cond=local)
        sampler = "pingpong" if config.objective == "rf_denoiser" else "euler"
        return run_sampler(velocity, x, sigmas, sampler, draws.steps()), size, sigmas


def traced(velocity: Callable, trace: dict) -> Callable:
    """The velocity, recording (x, t, v) of every step into trace['steps'] when tracing."""
    if "steps" not in trace:
        return velocity

    def call(x: mx.array, t: mx.array) -> mx.array:
        v = velocity(x, t)
        trace["steps"].append((x, t, v))
        return v

    return call


def generate(
    models: DemoModels,
    arc: bool,
    request: GenerateRequest,
    adapters: Sequence[AdapterRef] = (),
    draws=None,
    trace: dict | None = None,
) -> Generated:
    """Generate one clip. `trace`, if given (with a 'steps' list to record the steps), receives the
    intermediates the parity fixtures store."""
    request = request.resolved(arc)
    adapters = tuple(adapters)
    infos, adapted = adapter_infos(adapters)
    draws = draws if draws is not None else SeededDraws(0)
    trace = {} if trace is None else trace
    renderable = model_for(models, arc, adapters)
    latents, size, sigmas = sample_latents(models, arc, request, renderable, draws, trace)
    audio = decode_audio(models, arc, latents, draws, size)
    merged = bool(adapters) and renderable.live is None
    return Generated(audio, latents, size, sigmas, request, infos, adapted, merged)


def model_objective_is_arc(folder: str | Path) -> bool:
    """True for an ARC (rf_denoiser) model folder: it samples with ping-pong."""
    return ModelConfig.load(Path(folder) / MODEL_CONFIG_FILE).objective == "rf_denoiser"
