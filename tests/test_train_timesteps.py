"""Training timesteps against the `schedules` fixture (params from its params.json), plus the seeded wrappers."""

import numpy as np
import pytest
from conftest import FIXTURES

from sa3mlx.parity.compare import compare
from sa3mlx.parity.fixture import Fixture
from sa3mlx.sample.shifts import make_shift
from sa3mlx.train import timesteps as ts

FILE = "expected.npz"
PSNR_FLOOR = 75.0
SHIFT_GROUPS = [f"{name}_{path}" for name in ("full", "flux", "logsnr") for path in ("scalar", "tensor", "per_element")]
SAMPLER_GROUPS = {  # group -> (sampler, the params.json keys that are its options)
    "trunc_logit_normal_t": ("trunc_logit_normal", ("left_trunc", "right_trunc")),
    "logit_normal_t": ("logit_normal", ()),
    "log_snr_t": ("log_snr", ("mean_logsnr", "std_logsnr", "clamp_eps")),
    "log_snr_uniform_t": ("log_snr_uniform", ("min_logsnr", "max_logsnr", "clamp_eps")),
}


@pytest.fixture(scope="module")
def fx():
    return Fixture(FIXTURES / "schedules")


def _check(fx, group, value):
    (key,) = fx.groups(FILE)[group]["keys"]
    result = compare(key, fx.reference(FILE)[key], value)
    assert result.psnr_db >= PSNR_FLOOR, (key, result)
    return result


def _shift_value(fx, group):
    params = fx.params(FILE, group)
    refs = fx.inputs(FILE, group)
    shift = make_shift(params["dist_shift"])
    t, lengths = fx.load(refs["t_grid"]), fx.load(refs["seq_lens"])
    if group.endswith("_scalar"):
        return np.stack([shift.shift(t, int(n)) for n in lengths])
    if group.endswith("_per_element"):
        return shift.shift(t[: params["n"]], lengths)
    return shift.shift(t, lengths)


@pytest.mark.parametrize("group", SHIFT_GROUPS)
def test_training_shifts_match_fixture(fx, group):
    _check(fx, group, _shift_value(fx, group))


def test_trunc_logit_normal_raw_matches_fixture(fx):
    params = fx.params(FILE, "trunc_logit_normal_raw")
    z = fx.load(fx.inputs(FILE, "trunc_logit_normal_raw")["z"])
    _check(fx, "trunc_logit_normal_raw", ts.trunc_logit_normal_raw(z, params["left_trunc"], params["right_trunc"]))


@pytest.mark.parametrize("group", sorted(SAMPLER_GROUPS))
def test_sampler_transforms_match_fixture(fx, group):
    sampler, option_keys = SAMPLER_GROUPS[group]
    params = fx.params(FILE, group)
    (draws,) = fx.inputs(FILE, group).values()
    options = {k: params[k] for k in option_keys}
    value = ts.TRANSFORMS[sampler](fx.load(draws), **options)
    assert value.dtype == np.float32 and value.shape == (params["n"],)
    _check(fx, group, value)


def test_effective_seq_len_matches_fixture(fx):
    params = fx.params(FILE, "effective_seq_len")
    seconds = fx.load(fx.inputs(FILE, "effective_seq_len")["seconds_total"])
    value = ts.effective_seq_len(seconds.tolist(), params["sample_rate"], params["downsampling_ratio"])
    assert _check(fx, "effective_seq_len", value).psnr_db == float("inf")


def test_logsnr_cond_matches_fixture(fx):
    params = fx.params(FILE, "logsnr_cond")
    t = fx.load(fx.inputs(FILE, "logsnr_cond")["t"])
    _check(fx, "logsnr_cond", ts.t_to_logsnr_cond(t, params["logsnr_min"], params["logsnr_max"], params["t_clamp_eps"]))


def test_sample_timesteps_is_seeded_and_in_range():
    for name in ts.SAMPLERS:
        a = ts.sample_timesteps(name, 256, np.random.default_rng(3))
        b = ts.sample_timesteps(name, 256, np.random.default_rng(3))
        assert a.dtype == np.float32 and np.array_equal(a, b)
        assert a.min() >= 0 and a.max() <= 1
    trunc = ts.sample_timesteps("trunc_logit_normal", 4096, np.random.default_rng(0))
    assert trunc.min() > 0 and trunc.max() <= 1 - 0.0  # t = 1 − r, r in [0, 1)


def test_rng_state_resumes_the_same_draws():
    rng = np.random.default_rng(7)
    ts.sample_timesteps("logit_normal", 5, rng)
    state = rng.bit_generator.state
    expected = ts.sample_timesteps("logit_normal", 5, rng)
    resumed = np.random.default_rng()
    resumed.bit_generator.state = state
    assert np.array_equal(ts.sample_timesteps("logit_normal", 5, resumed), expected)


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown timestep sampler"):
        ts.sample_timesteps("cosine", 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="no option"):
        ts.sample_timesteps("log_snr", 2, np.random.default_rng(0), {"mean": 1})
    with pytest.raises(ValueError, match="unknown distribution shift"):
        make_shift({"type": "cosine"})


def test_full_shift_closed_form_and_effective_length():
    shift = make_shift({"type": "full", "min_length": 256, "max_length": 4096})
    t = np.linspace(0.05, 0.95, 7, dtype=np.float32)
    for length in (100, 1300, 9000):
        clamped = min(max(length, 256), 4096)
        s = np.exp(0.5 + 0.65 * (clamped - 256) / (4096 - 256))
        np.testing.assert_allclose(shift.shift(t, length), s * t / (1 + (s - 1) * t), rtol=2e-6)
    # seconds_total is the full song, not the crop; without the flag the crop length is used
    assert ts.schedule_seq_len([180.0], 1300, True).tolist() == [1938.0]
    assert ts.schedule_seq_len([180.0], 1300, False) == 1300
    assert make_shift(None) is None
    assert np.array_equal(ts.shift_timesteps(t, make_shift({"type": "none"}), 10), t)
