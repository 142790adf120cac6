"""Parity kind `schedules`: timestep shifts, sampling schedules and the training-timestep
transforms of `schedules/`.

Shift groups name their shift in `params.dist_shift` (official class names; None = no shift);
`build_schedule` groups build an inference schedule with it; the remaining groups apply one
transform (a timestep sampler, the effective length, the log-SNR conditioning value) to the
draws or values the fixture stores.
"""

from __future__ import annotations

import numpy as np

from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import register
from sa3mlx.sample.schedule import build_schedule
from sa3mlx.sample.shifts import make_shift
from sa3mlx.train import timesteps

FILE = "expected.npz"
# group/key -> the transform of its single stored input
TRANSFORMS = {
    "trunc_logit_normal_raw": timesteps.trunc_logit_normal_raw,
    "trunc_logit_normal_t": timesteps.trunc_logit_normal_t,
    "logit_normal_t": timesteps.logit_normal_t,
    "log_snr_t": timesteps.log_snr_t,
    "log_snr_uniform_t": timesteps.log_snr_uniform_t,
    "effective_seq_len": timesteps.effective_seq_len,
    "logsnr_cond": timesteps.t_to_logsnr_cond,
}


def _shift_group(fixture: Fixture, group: str, shift, params: dict) -> np.ndarray:
    """`*_scalar` (row per python-int length), `*_tensor` (length grid), `*_per_element` (paired)."""
    refs = fixture.inputs(FILE, group)
    t, lengths = fixture.load(refs["t_grid"]), fixture.load(refs["seq_lens"])
    if group.endswith("_scalar"):
        return np.stack([shift.shift(t, int(n)) for n in lengths])
    if group.endswith("_per_element"):
        return shift.shift(t[: params["n"]], lengths)
    if group.endswith("_tensor"):
        return shift.shift(t, lengths)
    raise ValueError(f"{fixture.dir}: shift group '{group}' has no known layout")


def _schedule_group(shift, params: dict) -> np.ndarray:
    return build_schedule(
        params["steps"],
        sigma_max=params["sigma_max"],
        shift=shift,
        effective_seq_len=params.get("effective_seq_len"),
        fallback_seq_len=params.get("fallback_seq_len"),
        include_endpoint=params.get("include_endpoint", True),
    )


def _transform_group(fixture: Fixture, group: str, params: dict) -> np.ndarray:
    (ref,) = fixture.inputs(FILE, group).values()
    values = fixture.load(ref)
    options = {k: v for k, v in params.items() if k not in ("n", "dtype")}
    if "n" in params:
        values = values[: params["n"]]
    return TRANSFORMS[group](values, **options)


@register("schedules")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for group, spec in fixture.groups(FILE).items():
        params = fixture.params(FILE, group)
        if "dist_shift" in params:
            shift = make_shift(params["dist_shift"])
            is_schedule = spec.get("call", "").startswith("build_schedule")
            value = _schedule_group(shift, params) if is_schedule else _shift_group(fixture, group, shift, params)
        elif group in TRANSFORMS:
            value = _transform_group(fixture, group, params)
        else:
            continue
        (key,) = spec["keys"]
        out[key] = np.asarray(value, np.float32)
    return {FILE: out}
