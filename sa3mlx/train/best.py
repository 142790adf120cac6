"""The best checkpoint of a run (`train.best`): `models/lora/<name>-best.safetensors`.

With validation on, the best is the adapter of the validation step with the lowest `val/loss`
(the baseline at the start of a run is not a candidate). Without it, the candidates are the
checkpoints, judged by an exponential moving average of the training loss:

    ema_n = smoothing · ema_(n−1) + (1 − smoothing) · loss_n,   ema_0 = 0,   shown as ema_n / (1 − smoothing^n)

over the finite losses (bias-corrected as Adam's moments, so early values are not pulled to 0),
and only once `warmup` steps have been averaged (the EMA of the first steps follows a handful of
noisy losses). A run that ends without a candidate past the warm-up takes its final checkpoint as
the best. The file is underfit's adapter format with the step and epoch of the step it came from;
the EMA and the best value live in the resume state (kept across resumes); a fresh run removes a
stale best file first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sa3mlx.lora.checkpoint import save_lora
from sa3mlx.runtime.io import copy_atomic
from sa3mlx.train.contract import StepReport, TrainingCallback
from sa3mlx.train.progress import emit

KEYS = ("smoothing", "warmup")


@dataclass(frozen=True)
class BestSettings:
    smoothing: float = 0.9  # EMA weight of the previous value (underfit's loss chart smooths with 0.92)
    warmup: int = 50  # averaged steps before the EMA may pick a best

    @classmethod
    def from_params(cls, params: dict | None) -> BestSettings:
        params = dict(params or {})
        unknown = sorted(set(params) - set(KEYS))
        if unknown:
            raise ValueError(f"train.best: unknown key(s) {unknown}; known: {list(KEYS)}")
        settings = cls(**{k: v for k, v in params.items() if v is not None})
        if not 0.0 <= settings.smoothing < 1.0:
            raise ValueError(f"train.best.smoothing must be in [0, 1), got {settings.smoothing}")
        if settings.warmup < 0:
            raise ValueError(f"train.best.warmup must be >= 0, got {settings.warmup}")
        return settings


class LossEMA:
    def __init__(self, smoothing: float):
        self.smoothing, self.value, self.count = float(smoothing), 0.0, 0

    def update(self, loss: float) -> None:
        if math.isfinite(loss):
            self.value = self.smoothing * self.value + (1.0 - self.smoothing) * float(loss)
            self.count += 1

    @property
    def corrected(self) -> float:
        return self.value / (1.0 - self.smoothing**self.count) if self.count else math.nan


class BestCheckpoint(TrainingCallback):
    name = "best"

    def __init__(
        self,
        path: str | Path,
        settings: BestSettings,
        session,
        by_validation: bool,
        base_model: str | None = None,
        say: Callable[[str], None] = emit,
    ):
        self.path, self.settings, self.session = Path(path), settings, session
        self.by_validation, self.base_model, self.say = by_validation, base_model, say
        self.ema = LossEMA(settings.smoothing)
        self.best: float | None = None
        self.best_step: int | None = None

    @property
    def criterion(self) -> str:
        return "val/loss" if self.by_validation else f"train loss EMA {self.settings.smoothing:g}"

    def on_run_start(self, step: int, fresh: bool) -> None:
        if fresh and self.path.exists():
            self.path.unlink()  # a stale best of another run

    def on_step(self, report: StepReport) -> None:
        self.ema.update(report.output.loss)
        if self.by_validation or report.checkpoint is None or self.ema.count < self.settings.warmup:
            return
        self.consider(self.ema.corrected, report.step, report.epoch, report.checkpoint)

    def on_validation(self, step: int, epoch: int, result, report: StepReport | None) -> None:
        """A Validator listener: each validation of a trained step is a candidate."""
        self.consider(result.loss, step, epoch, report.checkpoint if report else None)

    def on_run_end(self, status: str, step: int, checkpoint: Path | None) -> None:
        if status == "done" and self.best is None and checkpoint is not None:
            copy_atomic(checkpoint, self.path)
            self.best_step = step
            self.say(f"best: no candidate past the warm-up ({self.criterion}); the final adapter -> {self.path}")

    def consider(self, value: float, step: int, epoch: int, checkpoint: Path | None) -> None:
        if not math.isfinite(value) or (self.best is not None and value >= self.best):
            return
        if checkpoint is not None:
            copy_atomic(checkpoint, self.path)
        else:
            save_lora(self.path, self.session.adapters, self.session.lora_config, step, epoch, self.base_model)
        self.best, self.best_step = float(value), step
        self.say(f"best: step {step} ({self.criterion} {value:.6f}) -> {self.path}")

    def state_dict(self) -> dict:
        return {
            "ema": self.ema.value,
            "count": self.ema.count,
            "best": self.best,
            "best_step": self.best_step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.ema.value, self.ema.count = float(state["ema"]), int(state["count"])
        self.best, self.best_step = state["best"], state["best_step"]
