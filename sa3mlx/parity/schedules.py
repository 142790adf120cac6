"""Parity kind `schedules`: timestep shifts and sampling schedules of `schedules/`.

Computed: every group whose shift type is in SHIFTS (the log-SNR sampling shift, any rate)
or that has no shift (`dist_shift: null`). The training shifts (`DistributionShift`,
`FluxDistributionShift`) and the timestep-sampler transforms join SHIFTS / this runner
with the trainer; until then their keys are reported as not computed.
"""

from __future__ import annotations

import numpy as np

from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import register
from sa3mlx.sample.schedule import LogSNRShift, build_schedule

FILE = "expected.npz"
SHIFTS = {"LogSNRShift": LogSNRShift.from_dict}  # official class name -> constructor from its params


class _Unsupported(Exception):
    pass


def _shift(spec):
    if spec is None:
        return None
    if spec.get("type") not in SHIFTS:
        raise _Unsupported(spec.get("type"))
    return SHIFTS[spec["type"]](spec)


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
    raise _Unsupported(group)


def _schedule_group(shift, params: dict) -> np.ndarray:
    return build_schedule(params["steps"], sigma_max=params["sigma_max"], shift=shift,
                          effective_seq_len=params.get("effective_seq_len"),
                          fallback_seq_len=params.get("fallback_seq_len"),
                          include_endpoint=params.get("include_endpoint", True))


@register("schedules")
def run(fixture: Fixture) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for group, spec in fixture.groups(FILE).items():
        params = fixture.params(FILE, group)
        if "dist_shift" not in params:
            continue  # timestep samplers and conditioning helpers: the trainer's groups
        try:
            shift = _shift(params["dist_shift"])
            is_schedule = spec.get("call", "").startswith("build_schedule")
            value = _schedule_group(shift, params) if is_schedule else _shift_group(fixture, group, shift, params)
        except _Unsupported:
            continue
        (key,) = spec["keys"]
        out[key] = value.astype(np.float32)
    return {FILE: out}
