"""The parity kinds: pass thresholds, default fixture folders, and their runners."""

from __future__ import annotations

import importlib
from collections.abc import Callable

# kind -> minimum PSNR (dB) every compared output must reach
THRESHOLDS_DB = {
    "dit": 75.0,
    "conditioner": 75.0,
    "schedules": 75.0,
    "t5gemma": 75.0,
    "same": 60.0,
    "lora": 85.0,
    "train_step": 60.0,
    "generate": 75.0,
}
# kind -> the fixture folders it recomputes (under tests/fixtures/ by default)
FOLDERS = {
    "dit": ("dit_small", "dit_medium"),
    "conditioner": ("conditioner",),
    "schedules": ("schedules",),
    "t5gemma": ("t5gemma",),
    "same": ("same",),
    "lora": ("lora",),
    "train_step": ("train_step",),
    "generate": ("generate",),
}
# runner(fixture) -> {expected file name: {key: array or JSON value}}
RUNNERS: dict[str, Callable] = {}


class ParityError(RuntimeError):
    pass


def register(kind: str):
    """Decorator for a kind's runner."""

    def wrap(runner: Callable) -> Callable:
        RUNNERS[kind] = runner
        return runner

    return wrap


def runner_for(kind: str) -> Callable:
    if kind not in THRESHOLDS_DB:
        raise ParityError(f"unknown parity kind '{kind}' (known: {', '.join(THRESHOLDS_DB)})")
    if kind not in RUNNERS:
        try:
            importlib.import_module(f"sa3mlx.parity.{kind}")
        except ModuleNotFoundError as e:
            if e.name != f"sa3mlx.parity.{kind}":
                raise
    if kind not in RUNNERS:
        raise ParityError(f"parity kind '{kind}' has no implementation yet")
    return RUNNERS[kind]
