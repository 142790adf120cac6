"""Strict key/shape validation of a state dict against the expected layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sa3mlx.convert.checkpoint import CheckpointError

SHOW = 20


def validate_shapes(state: dict[str, np.ndarray], expected: dict[str, tuple], source: str | Path, what: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped keys (first 20 of each)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(k for k in set(state) & set(expected) if tuple(state[k].shape) != tuple(expected[k]))
    if not (missing or unexpected or misshaped):
        return
    lines = [f"{source}: {what} does not match the expected layout"]
    lines += _section("missing", missing, lambda k: f"{k} {list(expected[k])}")
    lines += _section("unexpected", unexpected, lambda k: f"{k} {list(state[k].shape)}")
    lines += _section(
        "mis-shaped", misshaped, lambda k: f"{k}: got {list(state[k].shape)}, expected {list(expected[k])}"
    )
    raise CheckpointError("\n".join(lines))


def _section(title: str, keys: list[str], describe) -> list[str]:
    if not keys:
        return []
    more = f" (first {SHOW} shown)" if len(keys) > SHOW else ""
    return [f"  {len(keys)} {title} key(s){more}:"] + [f"    {describe(k)}" for k in keys[:SHOW]]
