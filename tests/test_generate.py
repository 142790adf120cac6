"""`sa3mlx generate`: the official generate's arithmetic against the `generate/` fixture, the parity
kind, and the command on the tiny models (text, audio to audio, inpainting, two adapters, errors)."""

import json

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, ROOT
from test_demo import misshaped_copy, random_adapter

from sa3mlx.cli import main
from sa3mlx.convert.model import convert_source
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check
from sa3mlx.runtime.io import sha256_file
from sa3mlx.runtime.layout import SAMPLE_RATE, SAMPLES_PER_LATENT
from sa3mlx.sample import generation
from sa3mlx.sample.audio_out import read_audio_length
from sa3mlx.sample.shifts import SA3_SAMPLING_SHIFT

GENERATE = FIXTURES / "generate"


def test_parity_generate_every_key_passes():
    report = check("generate", GENERATE)
    assert report.ok, "\n".join(report.lines())
    assert report.computed == 64
    assert min(c.psnr_db for _, c in report.rows) >= THRESHOLDS_DB["generate"]


@pytest.mark.parametrize("case", sorted(Fixture(GENERATE).spec["cases"]))
def test_lengths_and_masks_match_the_official_call(case):
    fixture = Fixture(GENERATE)
    spec, params = fixture.spec["cases"][case], fixture.params("expected.npz")
    kwargs = spec["kwargs"]
    size = generation.lengths(kwargs["duration"], SAMPLE_RATE, SAMPLES_PER_LATENT, 2, params["duration_padding_sec"])
    assert (size.samples, size.latents, size.valid) == (
        spec["audio_sample_size"],
        spec["latent_len"],
        spec["valid_latents"],
    )
    assert [float(size.effective)] == spec["effective_seq_len"]
    reference = fixture.reference("expected.npz")
    np.testing.assert_array_equal(generation.padding_mask(size), reference[f"{case}_padding_mask"])
    if "inpaint_mask_start_seconds" in kwargs:
        ranges = [(kwargs["inpaint_mask_start_seconds"], kwargs["inpaint_mask_end_seconds"])]
        mask = generation.inpaint_mask(ranges, kwargs["duration"], size, SAMPLE_RATE)
        np.testing.assert_array_equal(mask, reference[f"{case}_inpaint_mask"])


def test_init_audio_schedule_rises_first_unless_fixed():
    size = generation.lengths(3.0, SAMPLE_RATE, SAMPLES_PER_LATENT, 2)
    official = generation.schedule(8, 0.7, SA3_SAMPLING_SHIFT, size)[0]
    fixed = generation.schedule(8, 0.7, SA3_SAMPLING_SHIFT, size, monotonic=True)[0]
    assert official[0] == np.float32(0.7) and official[1] > official[0]  # the official quirk, kept
    assert fixed[0] == np.float32(0.7) and np.all(np.diff(fixed) < 0) and fixed[-1] == 0


def test_finish_audio_zeroes_padding_clamps_and_trims():
    size = generation.lengths(1.0, SAMPLE_RATE, SAMPLES_PER_LATENT, 2)
    decoded = np.full((1, 2, size.samples), 3.0, np.float32)
    audio = generation.finish_audio(decoded, size, SAMPLES_PER_LATENT)
    assert audio.shape == (1, 2, SAMPLE_RATE) and audio.max() == 1.0
    short = generation.lengths(1.0, SAMPLE_RATE, SAMPLES_PER_LATENT, 2, padding_s=0.0)
    tail = generation.finish_audio(np.ones((1, 2, short.samples), np.float32), short, SAMPLES_PER_LATENT)
    assert tail.shape[-1] == SAMPLE_RATE  # 1 s < the padded length: trimmed, all real frames kept
    assert short.valid * SAMPLES_PER_LATENT >= SAMPLE_RATE


# -- the command --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    for name in ("tiny-base", "tiny-arc"):
        convert_source(ROOT / "models" / name, root / name)
    random_adapter(root / "a.safetensors", root / "tiny-base")
    random_adapter(root / "b.safetensors", root / "tiny-base", adapter_type="lora", seed=5)
    misshaped_copy(root / "a.safetensors", root / "other.safetensors")
    source = ["generate", "source", "--model", str(root / "tiny-base"), "--seconds", "2", "--steps", "2", "--seed", "9"]
    assert main([*source, "--out", str(root / "source.wav")]) == 0
    return root


def run(tiny, out, *extra, model="tiny-base", seconds="1.5"):
    args = ["generate", "a warm pad", "--model", str(tiny / model), "--seconds", seconds, "--out", str(tiny / out)]
    assert main([*args, *extra]) == 0
    return tiny / out, json.loads((tiny / out).with_suffix(".json").read_text())


def test_text_to_audio_length_sidecar_and_same_seed_same_bytes(tiny):
    first, record = run(tiny, "t1.mp3", "--steps", "2", "--seed", "4")
    again, _ = run(tiny, "t2.mp3", "--steps", "2", "--seed", "4")
    other, _ = run(tiny, "t3.mp3", "--steps", "2", "--seed", "5")
    assert first.read_bytes() == again.read_bytes()
    assert first.with_suffix(".json").read_bytes() == again.with_suffix(".json").read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert read_audio_length(first) == (int(1.5 * SAMPLE_RATE), SAMPLE_RATE)
    assert record["samples"] == int(1.5 * SAMPLE_RATE) and record["seed"] == 4
    assert (record["sampler"], record["steps"], record["cfg"], record["apg"]) == ("euler", 2, 7.0, 1.0)
    assert record["init_audio"] is None and record["inpaint_audio"] is None and record["adapters"] == []
    assert len(record["sigmas"]) == 3 and record["sigmas"][0] == 1.0


def test_audio_to_audio_reads_resamples_and_records_the_source(tiny):
    source = tiny / "source.wav"
    audio, rate = sf.read(source, dtype="float32")
    sf.write(tiny / "source_48k.flac", audio[:48000], 48000, subtype="PCM_24")  # another rate and format
    init = ["--init-audio", str(tiny / "source_48k.flac"), "--init-noise-level", "0.7"]
    a2a, record = run(tiny, "a2a.flac", "--steps", "3", "--seed", "4", *init)
    text, _ = run(tiny, "text.flac", "--steps", "3", "--seed", "4")
    assert record["init_audio"] == {
        "path": str(tiny / "source_48k.flac"),
        "sha256": sha256_file(tiny / "source_48k.flac"),
        "init_noise_level": 0.7,
    }
    assert record["sigmas"][0] == pytest.approx(0.7) and record["sigmas"][1] > record["sigmas"][0]
    out, out_rate = sf.read(a2a, dtype="float32")
    assert out.shape == (int(1.5 * SAMPLE_RATE), 2) and out_rate == rate
    assert not np.array_equal(out, sf.read(text, dtype="float32")[0])
    fixed, fixed_record = run(tiny, "a2a_fixed.flac", "--steps", "3", "--seed", "4", *init, "--monotonic-schedule")
    assert fixed_record["monotonic_schedule"] and np.all(np.diff(fixed_record["sigmas"]) < 0)
    assert fixed.read_bytes() != a2a.read_bytes()


def test_inpainting_on_the_arc_model(tiny):
    ranges = ["--inpaint-range", "0.5:1", "--inpaint-range", "1.2,1.4"]
    out, record = run(
        tiny, "inpaint.wav", "--seed", "2", "--inpaint-audio", str(tiny / "source.wav"), *ranges, model="tiny-arc"
    )
    plain, _ = run(tiny, "plain_arc.wav", "--seed", "2", model="tiny-arc")
    assert (record["sampler"], record["steps"], record["cfg"]) == ("pingpong", 8, 1.0)
    assert record["inpaint_audio"]["ranges"] == [[0.5, 1.0], [1.2, 1.4]]
    assert record["inpaint_audio"]["sha256"] == sha256_file(tiny / "source.wav")
    audio = sf.read(out, dtype="float32")[0]
    assert audio.shape == (int(1.5 * SAMPLE_RATE), 2) and np.abs(audio).max() <= 1.0
    assert not np.array_equal(audio, sf.read(plain, dtype="float32")[0])


@pytest.mark.parametrize("model", ["tiny-base", "tiny-arc"])
def test_two_adapters_with_strengths_and_interval(tiny, model):
    adapters = ["--lora", f"{tiny / 'a.safetensors'}:0.5", "--lora", str(tiny / "b.safetensors")]
    steps = ["--steps", "3", "--seed", "1"]
    both, record = run(tiny, f"two_{model}.mp3", *steps, *adapters, "--lora-interval-max", "0.9", model=model)
    again, _ = run(tiny, f"two_again_{model}.mp3", *steps, *adapters, "--lora-interval-max", "0.9", model=model)
    plain, _ = run(tiny, f"none_{model}.mp3", *steps, model=model)
    assert both.read_bytes() == again.read_bytes() != plain.read_bytes()
    assert [(a["strength"], a["adapter_type"]) for a in record["adapters"]] == [(0.5, "dora-rows"), (1.0, "lora")]
    assert [a["sha256"] for a in record["adapters"]] == [
        sha256_file(tiny / n) for n in ("a.safetensors", "b.safetensors")
    ]
    assert record["adapted_layers"] == record["adapters"][0]["layers"] > 0
    assert record["lora_interval_max"] == 0.9 and record["adapters_applied"] == "merged"
    assert read_audio_length(both)[0] == int(1.5 * SAMPLE_RATE)


def test_one_adapter_on_the_base_model_is_live_like_the_demo(tiny):
    steps = ["--steps", "3", "--seed", "1", "--lora", f"{tiny / 'a.safetensors'}:0.7"]
    live, record = run(tiny, "live.mp3", *steps, "--lora-interval-max", "0.95")
    always, _ = run(tiny, "live_always.mp3", *steps)
    plain, _ = run(tiny, "live_none.mp3", "--steps", "3", "--seed", "1")
    assert len({live.read_bytes(), always.read_bytes(), plain.read_bytes()}) == 3
    assert record["adapters"][0]["strength"] == 0.7 and record["adapters_applied"] == "live"
    assert record["adapted_layers"] == record["adapters"][0]["layers"]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--model", "/nonexistent/model"], ["--model", "/nonexistent/model"]),
        (["--init-audio", "{root}/broken.wav"], ["--init-audio", "broken.wav", "unreadable"]),
        (["--inpaint-audio", "{root}/source.wav", "--inpaint-range", "1:3"], ["--inpaint-range", "outside the clip"]),
        (["--inpaint-audio", "{root}/source.wav"], ["--inpaint-audio", "--inpaint-range"]),
        (["--lora", "{root}/other.safetensors"], ["other.safetensors", "different base"]),
        (["--lora", "{root}/other.safetensors", "--lora", "{root}/b.safetensors"], ["other.safetensors", "tiny-base"]),
    ],
)
def test_errors_are_one_line_naming_the_flag_or_file(tiny, capsys, extra, words):
    (tiny / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    args = ["generate", "x", "--model", str(tiny / "tiny-base"), "--seconds", "2", "--steps", "1"]
    assert main(args + [e.format(root=tiny) for e in extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("sa3mlx: generate: ")
    assert all(word in err for word in words), err
