"""The demo renderer: its sampler path against the torch fixtures, its schedules, the sigma
interval, and a full render of base + ARC demos with baselines on the tiny models."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, ROOT
from safetensors.numpy import save_file

from sa3mlx.convert.checkpoint import read_safetensors
from sa3mlx.convert.model import convert_source
from sa3mlx.lora.checkpoint import save_lora
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.inject import inject_adapters
from sa3mlx.models.conditioning import DiTInputs, load_dit
from sa3mlx.parity.compare import psnr_db
from sa3mlx.parity.dit import load_fixture_dit
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.sample.audio_out import read_audio_length
from sa3mlx.sample.demo_entries import AdapterRef, DemoEntry, kept_samples, latent_count
from sa3mlx.sample.demo_models import DemoModels, LiveModel, Renderable
from sa3mlx.sample.render import (
    RenderOptions,
    arc_schedule,
    base_schedule,
    demo_latents,
    interval_velocity,
    live_velocity,
    render_demos,
    run_sampler,
)
from sa3mlx.sample.samplers import GuidedVelocity, fixed_noise

SAMPLER_KEYS = {"euler_4": "euler", "pingpong_4": "pingpong"}


def random_adapter(path, folder, adapter_type="dora-rows", rank=2, seed=1, scale=0.3):
    """An adapter file with non-zero random updates for the converted model in `folder`."""
    dit, cond = load_dit(folder / "dit.npz")
    cfg = LoRAConfig(adapter_type=adapter_type, rank=rank)
    layers = inject_adapters(dit, cond, cfg, key=mx.random.key(seed), announce=False)
    keys = mx.random.split(mx.random.key(seed + 1), len(layers))
    for key, layer in zip(keys, layers.values()):
        name = "M_xs" if "M_xs" in layer else "lora_B"
        layer[name] = mx.random.normal(layer[name].shape, key=key) * scale
    return save_lora(path, layers, cfg, step=100, epoch=1)


def misshaped_copy(path, out):
    """The adapter with one lora_A one column wider: as if trained for a model of other sizes."""
    tensors, metadata = read_safetensors(path)
    key = next(k for k in sorted(tensors) if k.endswith("lora_A"))
    tensors[key] = np.concatenate([tensors[key], tensors[key][:, :1]], axis=1)
    save_file(tensors, str(out), metadata=metadata)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Converted tiny base + ARC models and two random adapters."""
    root = tmp_path_factory.mktemp("tiny")
    for name in ("tiny-base", "tiny-arc"):
        convert_source(ROOT / "models" / name, root / name)
    random_adapter(root / "a.safetensors", root / "tiny-base")
    random_adapter(root / "b.safetensors", root / "tiny-base", adapter_type="lora", seed=5)
    return root


@pytest.mark.parametrize("key", SAMPLER_KEYS)
def test_demo_sampler_reproduces_the_fixture(key):
    """The demo path (live adapter at strength 0, sigma-interval switch) with the stored sigmas
    and noise injected gives the torch sampler's result before decoding."""
    fixture = Fixture(FIXTURES / "dit_small")
    dit, cond = load_fixture_dit(fixture, "expected.npz")
    layers = inject_adapters(dit, cond, LoRAConfig(rank=2), key=mx.random.key(0), announce=False)
    for layer in layers.values():
        layer.lora_B = mx.ones(layer.lora_B.shape)  # an adapter that would change the output
    inputs = {
        name: fixture.load(ref)
        for name, ref in fixture.inputs("expected.npz", key).items()
        if ref.startswith("inputs.npz:")
    }
    params = fixture.params("expected.npz", key)
    assert params["cfg_scale"] == 1.0
    conditioning = DiTInputs(
        mx.array(inputs["cross_attn_cond"]), mx.array(inputs["global_cond"]), mx.array(inputs["local_add_cond"])
    )
    renderable = Renderable(dit, cond, LiveModel(dit, cond, layers), 0.0)
    guided = GuidedVelocity(dit, conditioning, cfg_scale=params["cfg_scale"])
    sigmas = np.asarray(inputs["sigmas"], np.float32)
    # adapter on only for sigma <= 0: never at the evaluated sigmas, so this is the base model
    velocity = interval_velocity(live_velocity(renderable, guided, 1.0), live_velocity(renderable, guided, 0.0), 0.0)
    noise = fixed_noise(inputs["noise"]) if "noise" in inputs else None
    out = run_sampler(velocity, mx.array(inputs["x"]), sigmas, SAMPLER_KEYS[key], noise)
    reference = fixture.reference("expected.npz")[key]
    psnr = psnr_db(reference, np.array(out))
    print(f"{key}: PSNR {psnr:.1f} dB")
    assert psnr >= THRESHOLDS_DB["dit"]


@pytest.mark.parametrize("key", ["sched_8_full_L100", "sched_8_full_L1300", "sched_8_full_L4096", "sched_8"])
def test_demo_schedules_match_the_fixture(key):
    fixture = Fixture(FIXTURES / "schedules")
    p = fixture.params("expected.npz", key)
    assert p["sigma_max"] == 1.0
    if p["dist_shift"]["type"] == "DistributionShift":
        got = base_schedule(p["steps"], p["dist_shift"], p["fallback_seq_len"])
    else:
        got = arc_schedule(p["steps"], p["dist_shift"], p["fallback_seq_len"])
    assert psnr_db(fixture.reference("expected.npz")[key], got) >= THRESHOLDS_DB["schedules"]


def test_sigma_interval_uses_the_plain_model_above_the_threshold():
    calls = []
    adapted = lambda x, t: calls.append(("on", float(t[0]))) or x  # noqa: E731
    plain = lambda x, t: calls.append(("off", float(t[0]))) or x  # noqa: E731
    velocity = interval_velocity(adapted, plain, 0.5)
    for sigma in (1.0, 0.7, 0.5, 0.2):
        velocity(mx.zeros((1, 2, 3)), mx.array([sigma]))
    assert [c[0] for c in calls] == ["off", "off", "on", "on"]
    assert interval_velocity(adapted, plain, None) is adapted


def test_entries_take_underfits_defaults_and_reject_typos():
    base = DemoEntry.from_dict({"prompt": "a"})
    arc = DemoEntry.from_dict({"prompt": "a", "arc": True, "steps": None})
    assert (base.steps, base.cfg, base.sampler) == (50, 7.0, "euler")
    assert (arc.steps, arc.cfg, arc.sampler) == (8, 1.0, "pingpong")
    assert DemoEntry.from_dict({"prompt": "a"}, {"base": {"steps": 6}}).steps == 6
    with pytest.raises(ValueError, match="unknown field"):
        DemoEntry.from_dict({"prompt": "a", "sconds": 3})
    assert base.sidecar(baseline=True)["lora_strength"] == 0.0
    assert list(arc.sidecar())[:5] == ["prompt", "cfg", "arc", "steps", "seed"]
    assert latent_count(4, 44100, 4096, 2) == 98 and kept_samples(4, 44100) == 9 * 44100


def test_multi_adapter_merge_matches_the_live_adapter(tiny):
    """The same adapter rendered live and merged (torch strength semantics) agree."""
    models = DemoModels(tiny / "tiny-base", tiny / "tiny-arc")
    entry = DemoEntry(prompt="kick", seconds=1, seed=3, steps=3, cfg=1.0)
    default = (AdapterRef(tiny / "a.safetensors", 0.6),)
    live = models.renderable(False, default, default, False)
    merged = models.renderable(False, default, (), False)
    assert live.live is not None and merged.live is None
    for layer in live.live.layers.values():
        layer.strength = 0.25  # whatever the owner had set
    a = demo_latents(models, entry, live, 8)
    b = demo_latents(models, entry, merged, 8)
    psnr = psnr_db(np.array(a), np.array(b))
    print(f"live vs merged: PSNR {psnr:.1f} dB")
    assert psnr > 40  # merged weights are stored fp16, like the base
    assert all(layer.strength == 0.25 for layer in live.live.layers.values())  # restored as found


def test_render_base_and_arc_demos_with_baselines(tiny, tmp_path):
    bad = misshaped_copy(tiny / "a.safetensors", tmp_path / "bad.safetensors")
    out = tmp_path / "demos"
    entries = [
        {
            "prompt": "house drums",
            "seconds": 1,
            "seed": 1,
            "steps": 3,
            "cfg": 7,
            "lora_interval_max": 0.9,
            "negative_prompt": "noise",
        },
        {"prompt": "pad", "seconds": 1.5, "seed": 2, "steps": 2, "arc": True},
        {
            "prompt": "",
            "seconds": 1,
            "seed": 3,
            "steps": 2,
            "cfg": 1,
            "adapters": [{"path": str(tiny / "a.safetensors"), "strength": 0.5}, str(tiny / "b.safetensors") + ":0.7"],
        },
    ]
    options = RenderOptions(tail_seconds=1.0, wav=True)
    models = DemoModels(tiny / "tiny-base", tiny / "tiny-arc")
    summary = render_demos(
        out, 100, entries, models, [tiny / "a.safetensors"], baselines=True, options=options, say=lambda _: None
    )
    stems = ["baseline_0", "demo_0_00000100", "baseline_1", "demo_1_00000100", "baseline_2", "demo_2_00000100"]
    assert summary.rendered == stems and not summary.skipped
    for stem, seconds in zip(stems, (1, 1, 1.5, 1.5, 1, 1)):
        assert read_audio_length(out / f"{stem}.mp3") == (kept_samples(seconds, 44100, 1.0), 44100)
        assert read_audio_length(out / f"{stem}.wav")[0] == kept_samples(seconds, 44100, 1.0)
        assert (out / "spectrograms" / f"{stem}.png").is_file()
    sidecar = json.loads((out / "demo_0_00000100.json").read_text())
    assert sidecar["lora_skip"] == 0.9 and sidecar["lora_strength"] == 1.0 and sidecar["cfg"] == 7
    assert json.loads((out / "demo_1_00000100.json").read_text())["arc"] is True
    assert (out / "demo_0_00000100.mp3").read_bytes() != (out / "baseline_0.mp3").read_bytes()
    page = (out / "index.html").read_text()
    assert all(f'src="{stem}.mp3"' in page for stem in stems) and "(no prompt: unconditional)" in page

    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "index.html"}
    again = render_demos(
        out, 100, entries, models, [tiny / "a.safetensors"], baselines=True, options=options, say=lambda _: None
    )
    assert again.rendered == [] and sorted(again.existing) == sorted(stems)
    assert before == {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "index.html"}

    arc_only = [{"prompt": "pad", "seconds": 1, "seed": 2, "steps": 2, "arc": True, "adapters": [str(bad)]}]
    skipped = render_demos(tmp_path / "skip", 5, arc_only, models, baselines=True, options=options, say=lambda _: None)
    assert skipped.rendered == ["baseline_0"] and "does not fit the ARC model" in skipped.skipped[0]
    assert "does not fit the ARC model" in (tmp_path / "skip" / "index.html").read_text()
