"""Guards of training: empty prompts at the start, non-finite losses and stalled steps.

At the start, the count of training items no prompt source can give a prompt (no tags, no
path / fixed text / trigger when the template uses them): more than half of them trains a
mostly unconditional adapter, a warning, or with `train.strict` an error.

A non-finite loss (or gradient) skips the update (the session does that); the guard counts
them, says so, and after `limit` in a row stops the run. Since skipped steps leave the adapter
untouched, the checkpoint the loop then writes holds the last good adapter. The watchdog warns
when a step takes over `factor` times the running median and over a second (on a near-out-of-memory machine a
step freezes in swap long before anything crashes).
"""

from __future__ import annotations

import statistics
from collections import deque

from sa3mlx.data.prompts import has_prompt_source

EMPTY_PROMPT_LIMIT = 0.5  # above this share of items without a prompt: warn, or fail when strict
MIN_HISTORY = 5  # steps before the watchdog judges (the first ones compile)
MIN_STALL_SECONDS = 1.0  # shorter steps are never a stall (timer noise on tiny models)


def empty_prompt_lines(dataset, strict: bool) -> list[str]:
    """The start-of-run prompt census of a PreEncodedDataset; raises when strict and over the limit."""
    empty = []
    for index, entry in enumerate(dataset.files):
        info = dataset.sidecar(index)
        info.setdefault("relpath", entry.relpath)
        if not has_prompt_source(info, dataset.prompts):
            empty.append(entry.relpath)
    total = len(dataset.files)
    lines = [f"train: prompts: {len(empty)} of {total} training items have an empty prompt (no tags or other source)"]
    if len(empty) <= EMPTY_PROMPT_LIMIT * total:
        return lines
    problem = (
        f"more than half of the training items ({len(empty)} of {total}, e.g. {empty[:3]}) have no prompt: "
        "the adapter would train mostly unconditionally. Tag the files (normalize writes <name>.json) or set "
        "train.prompts (paths / fixed text / a trigger word)"
    )
    if strict:
        raise ValueError(f"train.strict: {problem}")
    return lines + [f"train: WARNING: {problem} (train.strict: true makes this an error)"]


class NonFiniteGuard:
    def __init__(self, limit: int):
        self.limit = int(limit)
        self.in_a_row = 0
        self.total = 0
        self.first_bad_step: int | None = None

    def update(self, finite: bool, step: int, loss: float) -> str | None:
        """Record one step (1-based global step just completed); a message for a skipped one."""
        if finite:
            self.in_a_row, self.first_bad_step = 0, None
            return None
        self.in_a_row += 1
        self.total += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        return (
            f"[guard] non-finite loss ({loss}) at step {step}: update skipped "
            f"({self.in_a_row} in a row, {self.total} in this run; stop at {self.limit} in a row)"
        )

    @property
    def tripped(self) -> bool:
        return self.in_a_row >= self.limit

    def stop_message(self, checkpoint: str) -> str:
        return (
            f"[guard] stopping: {self.in_a_row} non-finite losses in a row (steps {self.first_bad_step}"
            f"-{self.first_bad_step + self.in_a_row - 1}). No update was applied on those steps, so "
            f"{checkpoint} holds the last good adapter. Lower train.lr, set train.grad_clip, or check the "
            f"latents for NaN/inf before resuming."
        )

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total, "first_bad_step": self.first_bad_step}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row = int(state.get("in_a_row", 0))
        self.total = int(state.get("total", 0))
        self.first_bad_step = state.get("first_bad_step")


class StallWatchdog:
    def __init__(self, factor: float = 10.0, window: int = 100, min_seconds: float = MIN_STALL_SECONDS):
        self.factor, self.min_seconds = float(factor), float(min_seconds)
        self.times: deque[float] = deque(maxlen=window)

    def update(self, step: int, seconds: float) -> str | None:
        """A warning when this step took over `factor` × the median of the previous ones."""
        warning = None
        if len(self.times) >= MIN_HISTORY:
            median = statistics.median(self.times)
            if seconds > max(self.factor * median, self.min_seconds):
                ratio = seconds / max(median, 1e-9)
                warning = (
                    f"[watchdog] step {step} took {seconds:.2f} s, {ratio:.0f}x the median {median:.3f} s: "
                    "the machine may be out of memory and swapping"
                )
        self.times.append(float(seconds))
        return warning
