"""Validation loss (`train.validation`): the adapter's loss on held-out latents at a fixed grid of
timesteps, with fixed noise, fixed crops, fixed prompts and fixed inpainting masks, so the same
adapter always gets the same value.

    settings = ValidationSettings.from_params(params["train"].get("validation"))   # every: 0 = off
    train_files, val_files = settings.split(find_latents("data/latents"), seed)    # or a folder of its own
    validator = Validator(settings, session, val_dataset, seed, metrics)           # a TrainingCallback

At the start of a fresh run (the untrained baseline) and every `every` steps it logs `val/loss`
(the mean over files and grid points) and `val/loss_t<t>` per grid point to the run's metrics.
The grid t is the timestep the model sees (no training shift); noise, masks and crops come from
generators seeded by (seed, VALIDATION_STREAM) alone; prompts are encoded once, outside the
training prompt cache. It only reads the adapters: a run is bit-exact with validation on or off
(the split aside: held-out files are not trained on).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from sa3mlx.data.dataset import LatentFile, PreEncodedDataset
from sa3mlx.data.prompts import build_prompt
from sa3mlx.train.contract import StepReport, TrainingCallback
from sa3mlx.train.demos import uncached
from sa3mlx.train.objective import ObjectiveConfig, draw_noise, random_inpaint_masks
from sa3mlx.train.progress import emit
from sa3mlx.train.step import batch_loss

VALIDATION_STREAM = 0x56414C  # "VAL": the split, the crops, the noise and the masks of validation
DEFAULT_TIMESTEPS = (0.1, 0.3, 0.5, 0.7, 0.9)
KEYS = ("every", "fraction", "folder", "timesteps", "batch_size")
LOSS_METRIC = "val/loss"


def per_t_metric(t: float) -> str:
    return f"{LOSS_METRIC}_t{t:.2f}"


@dataclass(frozen=True)
class ValidationSettings:
    every: int = 0  # steps between validations; 0: off
    fraction: float = 0.1  # of the files in data/latents, held out (when no folder is given)
    folder: str | None = None  # a latent folder of its own instead (nothing held out of training)
    timesteps: tuple[float, ...] = DEFAULT_TIMESTEPS
    batch_size: int = 4  # validation items per forward pass

    @classmethod
    def from_params(cls, params: dict | None) -> ValidationSettings:
        params = dict(params or {})
        unknown = sorted(set(params) - set(KEYS))
        if unknown:
            raise ValueError(f"train.validation: unknown key(s) {unknown}; known: {list(KEYS)}")
        if params.get("timesteps") is not None:
            params["timesteps"] = tuple(float(t) for t in params["timesteps"])
        settings = cls(**{k: v for k, v in params.items() if v is not None or k == "folder"})
        settings.check()
        return settings

    def check(self) -> None:
        if self.every < 0:
            raise ValueError(f"train.validation.every must be >= 0 (0: off), got {self.every}")
        if self.folder is None and not 0.0 < self.fraction < 1.0:
            raise ValueError(f"train.validation.fraction must be in (0, 1), got {self.fraction}")
        if not self.timesteps or any(not 0.0 < t <= 1.0 for t in self.timesteps):
            raise ValueError(f"train.validation.timesteps must be values in (0, 1], got {list(self.timesteps)}")
        if len({per_t_metric(t) for t in self.timesteps}) != len(self.timesteps):
            raise ValueError(f"train.validation.timesteps must differ in 2 decimals: {list(self.timesteps)}")
        if self.batch_size < 1:
            raise ValueError(f"train.validation.batch_size must be >= 1, got {self.batch_size}")

    @property
    def on(self) -> bool:
        return self.every > 0

    @property
    def holds_out(self) -> bool:
        """Files of the training folder are held out (validation on, no folder of its own)."""
        return self.on and self.folder is None

    def split(self, files: list[LatentFile], seed: int) -> tuple[list[LatentFile], list[LatentFile]]:
        """(training files, validation files): `fraction` of them (at least one), drawn from the seed."""
        if not self.holds_out:
            return list(files), []
        count = max(1, round(self.fraction * len(files)))
        if count >= len(files):
            raise ValueError(
                f"train.validation.fraction {self.fraction} of {len(files)} files leaves none to train on: "
                "lower it, add files, or give train.validation.folder"
            )
        rng = np.random.default_rng([int(seed), VALIDATION_STREAM])
        chosen = set(int(i) for i in rng.choice(len(files), size=count, replace=False))
        return [f for i, f in enumerate(files) if i not in chosen], [f for i, f in enumerate(files) if i in chosen]


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    per_t: dict[float, float]

    def metrics(self) -> dict[str, float]:
        return {LOSS_METRIC: self.loss, **{per_t_metric(t): v for t, v in self.per_t.items()}}


class Validator(TrainingCallback):
    """Validation at the start of a fresh run and every `every` steps (not on a step the run stops at)."""

    def __init__(
        self,
        settings: ValidationSettings,
        session,
        dataset: PreEncodedDataset,
        seed: int,
        metrics=None,
        say: Callable[[str | list[str]], None] = emit,
        prompts=None,
    ):
        """`session`: a TrainingSession (its dit, cond, objective); `prompts`: the encoder to use
        (default: the session's, without its cache); `metrics`: where to log (TrainingMetrics)."""
        self.settings, self.session, self.metrics, self.say = settings, session, metrics, say
        self.objective = _validation_objective(session.objective)
        self.batches = _fixed_batches(dataset, settings, seed, self.objective, prompts or uncached(session.prompts))
        self.files = len(dataset)
        self.listeners: list[Callable[[int, int, ValidationResult, object], None]] = []

    def evaluate(self) -> ValidationResult:
        """The current adapter's validation loss (read only; no state changes)."""
        sums = {t: 0.0 for t in self.settings.timesteps}
        for arrays, count in self.batches:
            for t in self.settings.timesteps:
                batch = {**arrays, "t": mx.full((count,), t, mx.float32)}
                _, per_sample, _ = batch_loss(self.session.dit, self.session.cond, batch, self.objective)
                sums[t] += float(mx.sum(per_sample).item())
        per_t = {t: total / self.files for t, total in sums.items()}
        return ValidationResult(float(np.mean(list(per_t.values()))), per_t)

    def on_run_start(self, step: int, fresh: bool) -> None:
        grid, every = len(self.settings.timesteps), self.settings.every
        self.say(f"validation: {self.files} files x {grid} timesteps every {every} steps")
        if fresh:
            self._validate(step, None, baseline=True)

    def on_step(self, report: StepReport) -> None:
        if not report.stopping and report.step % self.settings.every == 0:
            self._validate(report.step, report)

    def _validate(self, step: int, report: StepReport | None, baseline: bool = False) -> None:
        result = self.evaluate()
        if self.metrics is not None:
            self.metrics.log(step, result.metrics())
        if not math.isfinite(result.loss):
            self.say(f"validation at step {step}: non-finite loss {result.loss}")
        else:
            grid = ", ".join(f"t={t:g} {v:.4f}" for t, v in result.per_t.items())
            self.say(f"validation at step {step}: val/loss {result.loss:.6f} ({grid})")
        if not baseline:
            for listener in self.listeners:
                listener(step, report.epoch, result, report)


def _validation_objective(objective: ObjectiveConfig) -> ObjectiveConfig:
    """The training objective without CFG dropout (validation is conditional)."""
    return replace(objective, cfg_dropout_prob=0.0)


def _fixed_batches(dataset: PreEncodedDataset, settings: ValidationSettings, seed: int, objective, prompts) -> list:
    """(StepCore arrays without t, item count) per chunk of the validation items. Each item is fixed
    on its own: its first crop, one prompt, noise and mask from a generator of (seed, item), the
    prompt encoded alone, so an item's inputs do not depend on the chunking."""
    items = [_fixed_item(dataset, index, seed, objective, prompts) for index in range(len(dataset))]
    batches = []
    for first in range(0, len(items), settings.batch_size):
        chunk = items[first : first + settings.batch_size]
        arrays = {key: mx.array(np.concatenate([item[key] for item in chunk])) for key in chunk[0]}
        batches.append((arrays, len(chunk)))
    return batches


def _fixed_item(dataset: PreEncodedDataset, index: int, seed: int, objective, prompts) -> dict:
    rng = np.random.default_rng([int(seed), VALIDATION_STREAM, 1, index])
    example = dataset.example(index, rng)  # random_crop off: the first crop
    text = build_prompt(example.info, dataset.prompts, random.Random(f"{seed}/{index}"))
    hidden, prompt_mask = prompts([text])
    x0, padding = example.latents[None], example.padding_mask[None]
    item = {
        "x0": x0,
        "noise": draw_noise(rng, x0.shape),
        "prompt_hidden": np.asarray(hidden),
        "prompt_mask": np.asarray(prompt_mask),
        "seconds": np.asarray([float(example.info["seconds_total"])], np.float32),
        "drop": np.zeros(1, bool),
        "padding_mask": padding,
    }
    if objective.inpainting:
        item["inpaint_mask"] = random_inpaint_masks(
            rng, padding, objective.inpaint_mask_probabilities, mask_padding=objective.dit_padding_mask
        )
    return item
