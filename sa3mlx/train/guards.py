"""Guards of the training loop: non-finite losses and stalled steps.

A non-finite loss (or gradient) skips the update (the session does that); the guard counts
them, says so, and after `limit` in a row stops the run. Since skipped steps leave the adapter
untouched, the checkpoint the loop then writes holds the last good adapter. The watchdog warns
when a step takes over `factor` times the running median and over a second (on a near-out-of-memory machine a
step freezes in swap long before anything crashes).
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_HISTORY = 5  # steps before the watchdog judges (the first ones compile)
MIN_STALL_SECONDS = 1.0  # shorter steps are never a stall (timer noise on tiny models)


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
