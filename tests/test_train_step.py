"""The training step: parity with the official step (train_step fixture), and a TrainingSession
on the converted tiny model (loss goes down, compiled == eager, bit-exact state round trip,
non-finite guard, gradient accumulation, the V-zeroing padding mask of the DiT)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, ROOT

from sa3mlx.convert.model import convert_source
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check
from sa3mlx.train.contract import Session
from sa3mlx.train.presets import resolve
from sa3mlx.train.session import TrainingSession

LOSS_KEYS = ("A_loss", "B_loss", "C_loss")


def test_parity_train_step():
    report = check("train_step", FIXTURES / "train_step")
    assert report.ok, report.lines()
    assert not report.missing
    rows = {f"{file}:{c.key}": c for file, c in report.rows}
    for name, c in rows.items():
        assert c.psnr_db >= THRESHOLDS_DB["train_step"], name
    grads = [c for name, c in rows.items() if name.startswith("grads_")]
    assert len(grads) == 3 * 45
    reference = np.load(FIXTURES / "train_step" / "expected.npz")
    for key in LOSS_KEYS:
        assert rows[f"expected.npz:{key}"].max_abs / abs(float(reference[key])) < 1e-4, key


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-base")
    convert_source(ROOT / "models" / "tiny-base", folder)
    return folder


def make_batch(seed: int = 0, size: int = 2, length: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    padding = np.ones((size, length), bool)
    padding[-1, length * 3 // 4 :] = False
    return {
        "latents": rng.standard_normal((size, 16, length)).astype(np.float32),
        "padding_mask": padding,
        "seconds_total": np.linspace(20.0, 200.0, size),
        "prompts": [f"prompt {i}" for i in range(size)],
    }


def session(folder, preset="underfit-dashboard", compile=False, **overrides) -> TrainingSession:
    return TrainingSession.build(folder, resolve(preset, {"lr": 1e-3, **overrides}), seed=3, compile=compile)


def run_steps(s: TrainingSession, steps, batch=None):
    batch = batch or make_batch()
    return [s.step(batch, np.random.default_rng([7, i])) for i in steps]


def test_session_loss_decreases_on_a_fixed_batch(tiny_model):
    s = session(tiny_model, "underfit-loop", lr=3e-3, cfg_dropout_prob=0.0)
    batch, rng_key = make_batch(), [1, 2]
    outs = [s.step(batch, np.random.default_rng(rng_key)) for _ in range(6)]
    assert all(o.finite and np.isfinite(o.loss) for o in outs)
    assert outs[-1].loss < outs[0].loss
    assert s.updates == 6 and outs[0].lr == 3e-3
    stats = s.prompt_cache_stats()
    assert stats["misses"] == 2 and stats["hits"] == 10 and np.isclose(stats["hit_rate"], 10 / 12)


def test_session_clips_and_reports(tiny_model):
    s = session(tiny_model)  # the dashboard preset: clip 1.0, InverseLR warm-up, random masks
    assert isinstance(s, Session)  # what the loop needs
    outs = run_steps(s, range(3))
    for o in outs:
        assert o.finite and o.grad_norm <= 1.0 + 1e-4 and 0 < o.t_mean <= 1 and o.lora_magnitude > 0
    assert outs[0].lr == pytest.approx(1e-3 * (1 - 0.995))
    assert s.next_lr == pytest.approx(s.schedule.lr(3))
    assert set(s.adapter_state()) == {k for k in s.adapter_state() if ".parametrizations.weight.0." in k}


def test_compiled_step_equals_eager(tiny_model):
    eager, compiled = session(tiny_model, compile=False), session(tiny_model, compile=True)
    for a, b in zip(run_steps(eager, range(3)), run_steps(compiled, range(3))):
        assert a.finite and b.finite
        assert np.isclose(a.loss, b.loss, rtol=1e-5) and np.isclose(a.grad_norm, b.grad_norm, rtol=1e-4)
    for key, value in eager.adapter_state().items():
        assert np.allclose(value, compiled.adapter_state()[key], rtol=1e-4, atol=1e-6), key


def test_state_dict_round_trip_is_bit_exact(tiny_model):
    first = session(tiny_model, compile=True)
    run_steps(first, range(2))
    state = first.state_dict()
    expected = run_steps(first, range(2, 4))
    resumed = session(tiny_model, compile=True)
    resumed.load_state_dict(state)
    got = run_steps(resumed, range(2, 4))
    assert [(o.loss, o.grad_norm, o.lr) for o in got] == [(o.loss, o.grad_norm, o.lr) for o in expected]
    for key, value in first.adapter_state().items():
        assert np.array_equal(value, resumed.adapter_state()[key]), key
    assert resumed.updates == first.updates == 4


def test_non_finite_loss_skips_the_update(tiny_model):
    s = session(tiny_model, compile=True)
    run_steps(s, range(1))
    before, opt_before = s.adapter_state(), s.state_dict()["optimizer"]
    bad = make_batch()
    bad["latents"][0, 0, 0] = np.nan
    out = s.step(bad, np.random.default_rng(0))
    assert not out.finite and np.isnan(out.loss) and np.isnan(out.grad_norm)
    assert s.updates == 1 and s.skipped == 1
    for key, value in s.adapter_state().items():
        assert np.array_equal(value, before[key]), key
    for key, value in s.state_dict()["optimizer"].items():
        assert key == "learning_rate" or np.array_equal(value, opt_before[key]), key  # moments and step kept
    assert run_steps(s, range(1, 2))[0].finite


def test_gradient_accumulation_equals_the_whole_batch(tiny_model):
    # a large Adam eps keeps the first update linear in the gradient (else ±lr wherever g ≈ 0)
    whole, split = session(tiny_model, eps=10.0), session(tiny_model, eps=10.0, grad_accum=2)
    prepared = whole.prepare(make_batch(), np.random.default_rng(0))  # the draws of the whole batch
    [one], halves = whole.micro_batches(prepared), split.micro_batches(prepared)
    assert [h["x0"].shape[0] for h in halves] == [1, 1]
    assert np.array_equal(np.concatenate([np.array(h["noise"]) for h in halves]), np.array(one["noise"]))
    whole.optimizer.learning_rate = split.optimizer.learning_rate = 1e-3
    loss_a, norm_a, _, _ = whole.core.run([one])
    loss_b, norm_b, _, _ = split.core.run(halves)
    assert np.isclose(loss_a.item(), loss_b.item(), rtol=1e-5) and np.isclose(norm_a.item(), norm_b.item(), rtol=1e-4)
    for key, value in whole.adapter_state().items():
        assert np.allclose(value, split.adapter_state()[key], rtol=1e-5, atol=1e-9), key
    out = split.step(make_batch(), np.random.default_rng(1))  # one batch split into grad_accum parts
    assert out.finite and split.updates == 1  # core.run above is not counted by the session
    with pytest.raises(ValueError, match="grad_accum"):
        split.step(make_batch(size=3), np.random.default_rng(1))


def test_dit_padding_mask_zeroes_padded_values(tiny_model):
    s = session(tiny_model)
    dit = s.dit
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 16, 8)).astype(np.float32))
    cross, glob = mx.array(rng.standard_normal((1, 5, 768)).astype(np.float32)), mx.zeros((1, 768))
    t = mx.array([0.5])
    plain = np.array(dit(x, t, cross, glob))
    assert np.array_equal(np.array(dit(x, t, cross, glob, padding_mask=mx.ones((1, 8), mx.bool_))), plain)
    padding = mx.array(np.arange(8)[None] < 6)
    masked = np.array(dit(x, t, cross, glob, padding_mask=padding))
    assert not np.allclose(masked, plain)
    assert np.all(np.isfinite(masked))
