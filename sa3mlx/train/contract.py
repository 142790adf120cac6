"""What the training loop needs from a session, and what it offers the code around it.

- `Session`: the loop's whole view of a training session (`TrainingSession`, and the tests'
  stand-in, implement it): one step from a batch and a generator, the lr the next step will use,
  the adapters and their state, the full resume state, the lr schedule.
- `TrainingCallback`: what runs around the steps (metrics, demos, validation, the best checkpoint),
  in the manner of mlx-lm's `TrainingCallback`: `on_run_start`, `on_step` after each step (and
  its adapter file), `on_checkpoint` after each save, `on_run_end`. A callback must not touch the session's
  training state: a resumed run stays bit-exact whatever the callbacks do. One with state of its
  own that a resume must continue (`state_dict` / `load_state_dict`) is saved in the resume state
  under its `name`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from sa3mlx.lora.config import LoRAConfig
    from sa3mlx.train.session import StepOutput


class LRSchedule(Protocol):
    name: str

    def lr(self, k: int) -> float: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Session(Protocol):
    adapters: dict  # layer name -> AdaptedLayer
    lora_config: LoRAConfig
    schedule: LRSchedule

    def step(self, batch: dict, rng: np.random.Generator) -> StepOutput: ...

    @property
    def next_lr(self) -> float: ...  # the lr the next step will use (underfit shows and logs this one)

    def prompt_cache_stats(self) -> dict: ...  # hits, misses, hit_rate (None when nothing was encoded)
    def adapter_state(self) -> dict[str, np.ndarray]: ...
    def load_adapter_state(self, state: dict) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class StepReport:
    """One completed step, as the callbacks see it (after the step's save, when there is one)."""

    step: int  # the global step just completed (1-based, the `Step N` of the bar)
    epoch: int
    output: StepOutput
    seconds: float  # wall time of the step
    lr: float  # the lr the next step will use, as shown and logged
    prompt_cache_hit_rate: float | None
    checkpoint: Path | None  # the checkpoint written at this step, else None
    stopping: bool  # the run stops after this step (signal, guard): nothing slow now


class TrainingCallback:
    """Every hook does nothing unless overridden."""

    name = ""  # non-empty: its `state_dict()` goes into the resume state under this key

    def on_run_start(self, step: int, fresh: bool) -> None:
        """Before the first step of a run: `fresh` is False when it continues a resume state."""

    def on_step(self, report: StepReport) -> None:
        """After each step, and after that step's adapter file when one was saved (its resume
        state is written after this hook, with this callback's state after this step)."""

    def on_checkpoint(self, path: Path, step: int, epoch: int) -> None:
        """After a checkpoint and its resume state are written."""

    def on_run_end(self, status: str, step: int, checkpoint: Path | None) -> None:
        """When the run returns (status done / interrupted / nonfinite; its newest checkpoint)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
