"""Parity kind `generate`: the official `StableAudioModel.generate` with init audio and inpainting
(`generate/`), recomputed by `sample.generate` — the path `sa3mlx generate` runs — on the fixture's
own tiny models (converted to fp32 in a temporary folder), with the official run's draws replayed.

Every call parameter comes from params.json: per case its `kwargs` (prompt, duration, steps,
cfg_scale, init/inpaint audio and their settings) and the file-level defaults in effect
(duration_padding_sec, sample_size, apg_scale, negative_prompt, the fixed sample_diffusion args).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from sa3mlx.convert.model import ConvertOptions, convert_source
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import ParityError, register
from sa3mlx.runtime.io import sha256_file
from sa3mlx.sample.demo_models import DemoModels
from sa3mlx.sample.generate import GenerateRequest, ReplayedDraws, generate, model_objective_is_arc

EXPECTED = "expected.npz"
# the official generate's fixed sample_diffusion arguments this path reproduces
REPRODUCED_FIXED_ARGS = {"mask_padding_attention": True, "use_effective_length_for_schedule": True, "batch_cfg": True}
REPRODUCED_DIT_DEFAULTS = {"cfg_interval": [0, 1], "scale_phi": 0.0, "cfg_norm_threshold": 0.0}


def check_defaults(fixture: Fixture, params: dict) -> None:
    """The file-level settings must be ones this path reproduces."""
    fixed, dit = params["sample_diffusion_fixed_args"], params["dit_defaults"]
    for name, wanted in {**REPRODUCED_FIXED_ARGS, "headroom_seconds": params["duration_padding_sec"]}.items():
        if fixed.get(name) != wanted:
            raise ParityError(f"{fixture.dir}: sample_diffusion {name} = {fixed.get(name)} is not reproduced")
    for name, wanted in REPRODUCED_DIT_DEFAULTS.items():
        if dit.get(name) != wanted:
            raise ParityError(f"{fixture.dir}: DiT {name} = {dit.get(name)} is not reproduced")
    if params["model_dtype"] != "float32" or params["batch_size"] != 1 or not params["truncate_output_to_duration"]:
        raise ParityError(f"{fixture.dir}: only fp32, batch 1, truncated output are reproduced")


def converted_models(fixture: Fixture, out: Path) -> dict[str, Path]:
    """The pinned model folders of the fixture, checked by sha256 and converted to fp32."""
    folders = {}
    for name, info in fixture.spec["models"].items():
        source = fixture.dir / "models" / name
        for file, digest in info["files"].items():
            if sha256_file(source / file) != digest:
                raise ParityError(f"{source / file}: sha256 differs from params.json (models.{name})")
        folders[name] = out / name
        convert_source(source, folders[name], ConvertOptions("float32", "float32", "float32"))
    return folders


def input_audio(fixture: Fixture, ref: str | None, sample_rate: int) -> np.ndarray | None:
    """`inputs.npz:key at 44100 Hz` -> the [C, n] waveform (no resampling: the fixture's rate is the model's)."""
    if ref is None:
        return None
    array_ref, _, rate = ref.partition(" at ")
    if int(rate.split()[0]) != sample_rate:
        raise ParityError(f"{fixture.dir}: {ref} is not at the model rate {sample_rate} Hz")
    return fixture.load(array_ref).astype(np.float32)


def case_request(fixture: Fixture, kwargs: dict, params: dict, sample_rate: int) -> GenerateRequest:
    starts, ends = kwargs.get("inpaint_mask_start_seconds"), kwargs.get("inpaint_mask_end_seconds")
    starts, ends = ([] if starts is None else np.atleast_1d(starts)), ([] if ends is None else np.atleast_1d(ends))
    return GenerateRequest(
        prompt=kwargs["prompt"],
        seconds=float(kwargs["duration"]),
        steps=int(kwargs["steps"]),
        cfg=float(kwargs["cfg_scale"]),
        apg_scale=float(kwargs.get("apg_scale", params["apg_scale"])),
        negative_prompt=kwargs.get("negative_prompt", params["negative_prompt"]),
        init_audio=input_audio(fixture, kwargs.get("init_audio"), sample_rate),
        init_noise_level=float(kwargs.get("init_noise_level", 1.0)),
        inpaint_audio=input_audio(fixture, kwargs.get("inpaint_audio"), sample_rate),
        inpaint_ranges=tuple(zip(map(float, starts), map(float, ends))),
        padding_s=float(params["duration_padding_sec"]),
        sample_size=int(params["sample_size"]),
    )


def case_draws(reference: dict, case: dict) -> ReplayedDraws:
    """The official run's draws of one case, by the names params.json lists them under."""
    stored = {draw["stored_as"].split("[")[0] for draw in case["draws"]}
    named = {name.removeprefix(f"{case['name']}_"): reference[name] for name in stored}
    return ReplayedDraws(
        named["noise"], named["bottleneck_noise"], named["decoder_mask_noise"], named.get("pingpong_noise")
    )


def case_outputs(name: str, result, trace: dict) -> dict[str, np.ndarray]:
    steps = trace["steps"]
    local = np.array(trace["local_add_cond"])
    out = {
        "inpaint_mask": local[:, :1],
        "local_add_cond": local,
        "padding_mask": np.array(trace["padding_mask"]).astype(bool),
        "sigmas": np.asarray(result.sigmas, np.float32),
        "x_start": np.array(trace["x_start"]),
        "step_x": np.stack([np.array(x) for x, _, _ in steps]),
        "step_t": np.stack([np.array(t) for _, t, _ in steps]),
        "step_v": np.stack([np.array(v) for _, _, v in steps]),
        "final_latent": np.array(result.latents),
        "audio": result.audio[None],
    }
    for key in ("init_latents", "inpaint_latents"):
        if key in trace:
            out[key] = np.array(trace[key])
    return {f"{name}_{key}": value for key, value in out.items()}


def conditioning_outputs(model: str, inputs) -> dict[str, np.ndarray]:
    prefix = f"cond_{model.replace('-', '_')}"
    return {
        f"{prefix}_cross_attn_cond": np.array(inputs.cross_attn_cond),
        f"{prefix}_cross_attn_mask": np.array(inputs.cross_attn_mask).astype(np.float32),
        f"{prefix}_global_cond": np.array(inputs.global_cond),
    }


def token_outputs(models: DemoModels, arc: bool, prompt: str) -> dict[str, np.ndarray]:
    tokens = models.prompt_encoder(arc).tokenizer([prompt])
    return {
        "prompt_input_ids": tokens.input_ids.astype(np.int64),
        "prompt_attention_mask": tokens.attention_mask.astype(bool),
    }


@register("generate")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    params = fixture.params(EXPECTED)
    check_defaults(fixture, params)
    reference = fixture.reference(EXPECTED)
    wanted = {key for group in fixture.groups(EXPECTED).values() for key in group["keys"]}
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = converted_models(fixture, Path(tmp))
        for model, folder in folders.items():
            arc = model_objective_is_arc(folder)
            models = DemoModels(folder, folder if arc else None, say=lambda _: None)
            rate = models.config(arc).sample_rate
            for name, case in fixture.spec["cases"].items():
                if case["model"] != model:
                    continue
                request = case_request(fixture, case["kwargs"], params, rate)
                trace: dict = {"steps": []}
                result = generate(models, arc, request, (), case_draws(reference, {**case, "name": name}), trace)
                out.update(case_outputs(name, result, trace))
                out.update(conditioning_outputs(model, trace["inputs"]))
                out.update(token_outputs(models, arc, request.prompt))
            models.release()
    return {EXPECTED: {key: value for key, value in out.items() if key in wanted}}
