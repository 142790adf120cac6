"""The run's time budget (`train.max_minutes`), counted in training seconds across resumes.

    budget = time_budget(session.schedule, max_minutes)
    budget.target(max_steps)   # the last step of the run: max_steps, or the WSD plan's when shorter
    budget.add(seconds)        # after each step
    budget.out_of_time()       # a plain wall-clock limit was reached: end the run now

Three kinds: none (run to max_steps), a wall-clock limit (end the run at the first step past it),
and the `wsd` schedule's budget, which is turned into a step plan once from a measured step time
(`needs_plan`, `probing`, `freeze`) and then ends the run at the plan's last step.
"""

from __future__ import annotations

import contextlib
import math

from sa3mlx.train.optim import WarmupStableDecay, WSDPlan


class TimeBudget:
    """No wall-clock budget: the run ends at max_steps."""

    def __init__(self):
        self.elapsed_seconds = 0.0

    def add(self, seconds: float) -> None:
        self.elapsed_seconds += float(seconds)

    def target(self, max_steps: int) -> int:
        return max_steps

    def out_of_time(self) -> bool:
        return False

    @property
    def needs_plan(self) -> bool:
        return False

    def stop_line(self, step: int) -> str:
        return f"time budget reached at step {step}"


class WallClockLimit(TimeBudget):
    def __init__(self, minutes: float):
        super().__init__()
        self.minutes = float(minutes)

    def out_of_time(self) -> bool:
        return self.elapsed_seconds >= self.minutes * 60

    def stop_line(self, step: int) -> str:
        return f"max_minutes ({self.minutes:g}) reached at step {step}"


class WSDBudget(TimeBudget):
    """The `wsd` schedule's budget: its elapsed seconds live in the schedule's state."""

    def __init__(self, schedule: WarmupStableDecay):
        super().__init__()
        self.schedule = schedule

    def add(self, seconds: float) -> None:
        super().add(seconds)
        self.schedule.add_elapsed(seconds)

    def target(self, max_steps: int) -> int:
        plan = self.schedule.plan
        return max_steps if plan is None else min(max_steps, plan.total_steps)

    @property
    def needs_plan(self) -> bool:
        return self.schedule.plan is None

    @contextlib.contextmanager
    def probing(self, max_steps: int):
        """A throw-away plan while probe steps are timed (the schedule needs one to give an lr)."""
        self.schedule.plan = WSDPlan(total_steps=max_steps + 2, warmup_steps=1, decay_steps=1, seconds_per_step=1.0)
        try:
            yield
        finally:
            self.schedule.plan = None

    def freeze(self, seconds_per_step: float, steps_done: int) -> str:
        """Freeze the plan; the console line that says what it became."""
        schedule = self.schedule
        plan = schedule.freeze(seconds_per_step, steps_done=steps_done)
        return (
            f"WSD: {schedule.max_minutes:g} min budget ({schedule.elapsed_seconds / 60:.1f} used) at "
            f"{seconds_per_step:.3f} s/step -> {plan.total_steps} steps (warm-up {plan.warmup_steps}, "
            f"decay {plan.decay_steps})"
        )


def time_budget(schedule, max_minutes: float | None) -> TimeBudget:
    """The budget of a run with this lr schedule: the wsd schedule's own, else a plain limit."""
    if isinstance(schedule, WarmupStableDecay):
        return WSDBudget(schedule)
    if max_minutes and not math.isinf(float(max_minutes)):
        return WallClockLimit(max_minutes)
    return TimeBudget()
