import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES

from sa3mlx.models.conditioning import DiTInputs
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check
from sa3mlx.sample.samplers import (
    GuidedVelocity,
    apg_project,
    fixed_noise,
    guide,
    sample,
    sample_euler,
    sample_pingpong,
)
from sa3mlx.sample.schedule import build_schedule

THIS_ISSUE = {
    "sched_8",
    "sched_4",
    "sched_50",
    "sched_8_sigma_max_0.7",
    "sched_8_none",
    "logsnr_rate0_scalar",
    "logsnr_rate0_tensor",
    "logsnr_rate0_per_element",
}


def test_schedules_parity():
    report = check("schedules", FIXTURES / "schedules")
    print("\n".join(report.lines()))
    assert report.ok
    computed = {c.key: c for _, c in report.rows}
    assert THIS_ISSUE <= computed.keys()
    assert all(c.psnr_db >= THRESHOLDS_DB["schedules"] for c in computed.values())


def test_default_eight_step_schedule():
    expected = [1, 0.9944, 0.9845, 0.9579, 0.8909, 0.7455, 0.5125, 0.2739, 0]
    assert build_schedule(8, fallback_seq_len=64) == pytest.approx(expected, abs=5e-5)
    assert build_schedule(8, fallback_seq_len=4096) == pytest.approx(expected, abs=5e-5)  # rate 0: no L


def test_sigma_max_below_one_matches_torch_and_offers_monotonic():
    torch_like = build_schedule(8, sigma_max=0.7, fallback_seq_len=64)
    assert torch_like[0] == np.float32(0.7) and torch_like[1] > 0.9  # pinned first value: not monotonic
    monotonic = build_schedule(8, sigma_max=0.7, fallback_seq_len=64, monotonic=True)
    assert monotonic[0] == pytest.approx(0.7) and monotonic[-1] == 0 and np.all(np.diff(monotonic) < 0)


def _perfect_velocity(target):
    """The exact rectified-flow velocity towards `target`: v = (x - x0)/t."""
    return lambda x, t: (x - target) / t[:, None, None]


def test_euler_and_pingpong_reach_the_target_with_the_exact_velocity():
    target, noise = mx.random.normal((2, 3, 5)), mx.random.normal((2, 3, 5))
    sigmas = build_schedule(4, fallback_seq_len=5)
    assert np.allclose(np.array(sample_euler(_perfect_velocity(target), noise, sigmas)), np.array(target), atol=1e-5)
    draws = np.random.default_rng(0).standard_normal((4, 2, 3, 5)).astype(np.float32)
    out = sample_pingpong(_perfect_velocity(target), noise, sigmas, fixed_noise(draws))
    assert np.allclose(np.array(out), np.array(target), atol=1e-5)


def _fake_dit(x, t, cross, glob, local=None):
    """Velocity that depends on the cross tokens, so cond and uncond branches differ."""
    return x * 0.5 + cross.sum(axis=(1, 2))[:, None, None] + glob.mean(axis=1)[:, None, None]


def test_guidance_batches_cond_and_zero_uncond():
    x, t = mx.random.normal((2, 3, 4)), mx.array([0.7, 0.7])
    inputs = DiTInputs(mx.random.normal((2, 5, 6)), mx.random.normal((2, 6)))
    v_c = _fake_dit(x, t, inputs.cross_attn_cond, inputs.global_cond)
    v_u = _fake_dit(x, t, mx.zeros_like(inputs.cross_attn_cond), inputs.global_cond)
    assert np.allclose(np.array(GuidedVelocity(_fake_dit, inputs)(x, t)), np.array(v_c))
    vanilla = GuidedVelocity(_fake_dit, inputs, cfg_scale=3.0, apg_scale=0.0)(x, t)
    d_c, d_u = x - 0.7 * v_c, x - 0.7 * v_u
    assert np.allclose(np.array(vanilla), np.array((x - (d_c + 2 * (d_c - d_u))) / 0.7), atol=1e-5)
    apg = GuidedVelocity(_fake_dit, inputs, cfg_scale=3.0)(x, t)
    assert np.allclose(np.array(apg), np.array(guide(x, t, v_c, v_u, 3.0, 1.0)), atol=1e-6)
    outside = GuidedVelocity(_fake_dit, inputs, cfg_scale=3.0, cfg_interval=(0.0, 0.5))(x, t)
    assert np.allclose(np.array(outside), np.array(v_c))


def test_apg_projection_is_orthogonal_per_sample():
    diff, direction = mx.random.normal((2, 3, 4)), mx.random.normal((2, 3, 4))
    parallel, orthogonal = apg_project(diff, direction)
    assert np.allclose(np.array(parallel + orthogonal), np.array(diff), atol=1e-6)
    assert np.allclose(np.array((orthogonal * direction).sum(axis=(1, 2))), 0, atol=1e-5)


def test_inpainting_pastes_kept_frames_back():
    init, noise = mx.random.normal((1, 2, 6)), mx.random.normal((1, 2, 6))
    keep = mx.array([[1, 1, 0, 0, 1, 0]])
    sigmas = build_schedule(4, sigma_max=0.8, fallback_seq_len=6)
    out = np.array(sample(lambda x, t: x * 0.1, noise, sigmas, init_latents=init, keep_mask=keep))
    kept = np.array(keep, bool)[0]
    assert np.array_equal(out[..., kept], np.array(init)[..., kept])
    assert not np.allclose(out[..., ~kept], np.array(init)[..., ~kept])


def test_random_noise_is_keyed_per_step_whatever_the_call_order():
    import mlx.core as mx

    from sa3mlx.sample.samplers import random_noise

    forward, shuffled = random_noise(mx.random.key(3)), random_noise(mx.random.key(3))
    in_order = [np.array(forward(i, (4,), mx.float32)) for i in range(3)]
    out_of_order = {i: np.array(shuffled(i, (4,), mx.float32)) for i in (2, 0, 1)}
    for i in range(3):
        np.testing.assert_array_equal(in_order[i], out_of_order[i])
    assert not np.array_equal(in_order[0], in_order[1])
