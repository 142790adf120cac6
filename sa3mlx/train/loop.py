"""The training loop: batches through a `Session`'s `step`, underfit's console output and
checkpoint cadence, resume states, guards, the time budget, and the callbacks.

    loop = TrainingLoop(session, loader, RunPaths.create("runs", "my-run"), LoopSettings.from_config(cfg),
                        callbacks=[TrainingMetrics("dvclive/train")], console=Console())
    loop.restore(state)          # or loop.start_from_adapter(path); neither: a fresh run
    result = loop.run()          # LoopResult: status done / interrupted / nonfinite, last checkpoint

The session is anything that implements `contract.Session`; what happens around the steps
(metrics, demos, validation, the best checkpoint) is a list of `contract.TrainingCallback`s:
`on_run_start` before the first step, `on_step` after each step and after that step's adapter
file (also for a step after which the run stops: `report.stopping`), `on_checkpoint` once the
checkpoint's resume state is written too (it holds the callbacks' state after that step),
`on_run_end`. The settings are frozen; a wall-clock limit or a WSD plan ends a run through the
time budget (`train/budget.py`).

Each step's random numbers come from a generator seeded by (seed, global step), and the data
order from the sampler's position, so a run resumed from a checkpoint continues bit-exactly.
The epoch counter follows underfit: it advances when the data is exhausted and once more when
the run ends at its target, so the final checkpoint's name carries the next epoch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from sa3mlx.data.dataset import BatchLoader
from sa3mlx.lora.checkpoint import apply_lora, lora_key, read_lora, save_lora
from sa3mlx.runtime.io import atomic_path
from sa3mlx.train import progress as P
from sa3mlx.train.budget import time_budget
from sa3mlx.train.contract import Session, StepReport, TrainingCallback
from sa3mlx.train.guards import NonFiniteGuard, StallWatchdog
from sa3mlx.train.resume import ResumeState, bare_offsets, resume_files, save_resume
from sa3mlx.train.runs import RunPaths, SaveRequests, prune_checkpoints

STEP_STREAM = 0x53544550  # "STEP": keeps the per-step generators apart from the dataset's streams
PREVIEW_PROMPTS = 10
EXIT_NONFINITE = 3


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of global step `step` (0-based): a pure function of (seed, step)."""
    return np.random.default_rng([int(seed), STEP_STREAM, int(step)])


@dataclass(frozen=True)
class LoopSettings:
    max_steps: int  # absolute global step target
    checkpoint_every: int = 1000
    keep_last: int | None = None
    max_nonfinite: int = 10
    max_minutes: float | None = None  # wsd: the budget; other schedules: a wall-clock limit
    seed: int = 42
    base_model: str | None = None  # written into the adapter metadata when known
    stall_factor: float = 10.0
    fingerprint: str = ""
    fingerprint_inputs: dict | None = None

    @classmethod
    def from_config(cls, cfg, **extra) -> LoopSettings:
        return cls(
            max_steps=cfg.max_steps,
            checkpoint_every=cfg.checkpoint_every,
            keep_last=cfg.keep_last,
            max_nonfinite=cfg.max_nonfinite,
            max_minutes=cfg.max_minutes,
            seed=cfg.seed,
            **extra,
        )


@dataclass
class LoopResult:
    status: str  # "done", "interrupted" (SIGINT/SIGTERM), "nonfinite"
    step: int
    checkpoint: Path | None  # the newest checkpoint of the run (written or resumed from)
    exit_code: int = 0


def batch_inputs(batch) -> dict:
    """What `Session.step` reads from a dataset Batch."""
    return {
        "latents": batch.latents,
        "padding_mask": batch.padding_mask,
        "seconds_total": batch.seconds_total,
        "prompts": batch.prompts,
    }


class TrainingLoop:
    def __init__(
        self,
        session: Session,
        loader: BatchLoader,
        run: RunPaths,
        settings: LoopSettings,
        callbacks: Sequence[TrainingCallback] = (),
        out: IO | None = None,
        console: P.Console | None = None,
    ):
        self.session, self.loader, self.run_paths, self.settings = session, loader, run, settings
        self.callbacks = list(callbacks)
        self.console = console or P.Console(out)
        self.budget = time_budget(session.schedule, settings.max_minutes)
        self.global_step = 0
        self.epoch_offset = 0  # epochs before this sampler's epoch 0 (a bare-adapter resume)
        self.guard = NonFiniteGuard(settings.max_nonfinite)
        self.watchdog = StallWatchdog(settings.stall_factor)
        self.last_checkpoint: Path | None = None
        self.resumed_from: int | None = None
        self.fresh = True  # False once the loop continues a resume state (or a run of its own)
        self._saved_step: int | None = None
        self._stop_at: int | None = None  # the step a wall-clock limit ended the run at
        self._pending: StepReport | None = None  # the last step's report, sent after the final save
        self._unfinished: tuple[Path, int] | None = None  # (checkpoint, epoch) whose resume state is due

    @property
    def out(self) -> IO:
        return self.console.out

    # ---- starting points ----------------------------------------------------------------------

    def restore(self, state: ResumeState, checkpoint: Path | None = None) -> None:
        """Continue exactly where a saved state left off."""
        self.session.load_adapter_state(state.adapter)
        self.session.load_state_dict(state.session)  # without "adapters": loaded just above
        self.loader.load_state_dict(state.sampler)
        loop = state.loop
        self.global_step, self.epoch_offset = state.step, int(loop.get("epoch_offset", 0))
        self.budget.elapsed_seconds = float(loop.get("elapsed_seconds", 0.0))
        self.guard.load_state_dict(loop.get("guard", {}))
        saved = loop.get("callbacks", {})
        for callback in self.callbacks:
            if callback.name and callback.name in saved:
                callback.load_state_dict(saved[callback.name])
        self.last_checkpoint, self.resumed_from, self._saved_step = checkpoint, state.step, state.step
        self.fresh = False
        _truncate_loss_log(self.run_paths.demos / P.LOSS_BY_TIMESTEP_FILE, state.step)

    def start_from_adapter(
        self, path: str | Path, step_offset: int | None = None, epoch_offset: int | None = None
    ) -> None:
        """A bare adapter (e.g. an underfit checkpoint): its tensors, fresh optimizer, underfit's
        offset ladder for the step and epoch to count from."""
        lora = read_lora(path)
        apply_lora(lora, self.session.adapters, self.settings.base_model)  # checks layers, type, base
        self.session.load_adapter_state(
            {lora_key(name, param): value for name, tensors in lora.layers.items() for param, value in tensors.items()}
        )
        self.global_step, self.epoch_offset = bare_offsets(
            path, lora.config, step_offset, epoch_offset, self.loader.sampler.batches_per_epoch
        )
        self.resumed_from = self.global_step

    # ---- the run ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.epoch_offset + self.loader.sampler.epoch

    def target_step(self) -> int:
        target = self.budget.target(self.settings.max_steps)
        return target if self._stop_at is None else min(target, self._stop_at)

    def run(self) -> LoopResult:
        self._announce()
        status, self._pending = "done", None
        with (
            SaveRequests(self.run_paths.save_now, self.out) as requests,
            P.LossByTimestepLog(self.run_paths.demos / P.LOSS_BY_TIMESTEP_FILE) as lbt,
        ):
            self._each(lambda c: c.on_run_start(self.global_step, self.fresh))
            epoch = self.epoch
            while self.global_step < self.target_step() and status == "done":
                epoch, status = self._run_epoch(requests, lbt)
            if status == "done" and self._saved_step != self.global_step:
                # underfit's epoch counter advances once more when the run ends at its target
                self.save_checkpoint(epoch + 1, final=True)
            if self._pending is not None:
                self._report(self._pending, stopping=False)  # the last step, after its (final) save
            self._finish_save()
        self.fresh = False
        self._each(lambda c: c.on_run_end(status, self.global_step, self.last_checkpoint))
        if status == "done":
            self.console.say(P.TRAINING_DONE)
            return LoopResult(status, self.global_step, self.last_checkpoint)
        code = 128 + requests.stop_signal if status == "interrupted" else EXIT_NONFINITE
        return LoopResult(status, self.global_step, self.last_checkpoint, code)

    def _run_epoch(self, requests: SaveRequests, lbt: P.LossByTimestepLog) -> tuple[int, str]:
        sampler = self.loader.sampler
        if sampler.position >= sampler.batches_per_epoch:
            sampler.epoch, sampler.position = sampler.epoch + 1, 0
        epoch = self.epoch
        bar = P.epoch_bar(
            self._batches(),
            self.global_step,
            epoch,
            total=sampler.batches_per_epoch,
            file=self.out,
            initial=sampler.position,
        )
        status, self.console.bar = "done", bar
        for batch in bar:
            self._plan_budget(batch)
            started = time.perf_counter()
            result = self.session.step(batch_inputs(batch), step_rng(self.settings.seed, self.global_step))
            seconds = time.perf_counter() - started
            finite = bool(result.finite) and math.isfinite(result.loss)
            if finite:
                lbt.write(self.global_step, result.t_mean, result.loss)
            self.global_step += 1
            self.budget.add(seconds)
            lr = float(self.session.next_lr)  # underfit shows the lr after stepping the scheduler
            P.report_step(bar, self.global_step, epoch, result.loss, lr, result.grad_norm, result.lora_magnitude)
            hit_rate = self.session.prompt_cache_stats().get("hit_rate")
            report = StepReport(self.global_step, epoch, result, seconds, lr, hit_rate, None, False)
            status = self._after_step(finite, result, seconds, epoch, requests)
            if status == "done" and self.global_step >= self.target_step():
                self._pending = report  # reported after the final save (run)
                break
            self._report(report, stopping=status != "done")
            if status != "done":
                break
        bar.close()
        self.console.bar = None
        return epoch, status

    def _batches(self):
        yield from self.loader.epoch()

    def _after_step(self, finite: bool, result, seconds: float, epoch: int, requests: SaveRequests) -> str:
        """Guards, watchdog and saves after a step; returns the loop status."""
        message = self.guard.update(finite, self.global_step, result.loss)
        if message:
            self.console.say(message)
        warning = self.watchdog.update(self.global_step, seconds)
        if warning:
            self.console.say(warning)
        if self.guard.tripped:
            path = self.save_checkpoint(epoch)
            self.console.say(self.guard.stop_message(path.name))
            return "nonfinite"
        if self.global_step % self.settings.checkpoint_every == 0 or requests.take_save() or requests.stopping:
            self.save_checkpoint(epoch)
        if requests.stopping:
            self.console.say(f"Stopped at step {self.global_step}; a resume continues from {self.last_checkpoint.name}")
            return "interrupted"
        if self.budget.out_of_time():
            self.console.say(self.budget.stop_line(self.global_step))
            self._stop_at = self.global_step
        return "done"

    def _report(self, report: StepReport, stopping: bool) -> None:
        """The step's callbacks, then the rest of its save: the resume state holds their state after it."""
        checkpoint = self.last_checkpoint if self._saved_step == report.step else None
        report = StepReport(**{**report.__dict__, "checkpoint": checkpoint, "stopping": stopping})
        self._each(lambda c: c.on_step(report))
        self._finish_save()

    def _each(self, call) -> None:
        """Run a hook on every callback, with the bar cleared while they run."""
        if not self.callbacks:
            return
        with self.console.bar_cleared():
            for callback in self.callbacks:
                call(callback)

    # ---- saving -------------------------------------------------------------------------------

    def save_checkpoint(self, epoch: int, final: bool = False) -> Path:
        """The adapter (underfit's file) now; its resume state, pruning and `on_checkpoint` once the
        step's callbacks have run (`_finish_save`). Atomic each."""
        if self._saved_step == self.global_step and self.last_checkpoint is not None and not final:
            return self.last_checkpoint
        path = self.run_paths.checkpoint_path(self.global_step, epoch)
        save_lora(
            path, self.session.adapters, self.session.lora_config, self.global_step, epoch, self.settings.base_model
        )
        self.last_checkpoint, self._saved_step, self._unfinished = path, self.global_step, (path, epoch)
        self.console.say(P.saved_line(path.name, final))
        return path

    def _finish_save(self) -> None:
        if self._unfinished is None:
            return
        path, epoch = self._unfinished
        self._unfinished = None
        save_resume(path, self.resume_state(epoch))
        prune_checkpoints(self.run_paths.root, self.settings.keep_last, resume_files)
        self._each(lambda c: c.on_checkpoint(path, self.global_step, epoch))

    def resume_state(self, epoch: int) -> ResumeState:
        session = dict(self.session.state_dict())
        adapter = session.pop("adapters", None)  # stored once, as the state's adapter
        return ResumeState(
            step=self.global_step,
            epoch=epoch,
            fingerprint=self.settings.fingerprint,
            sampler=self.loader.state_dict(),
            session=session,
            adapter=self.session.adapter_state() if adapter is None else adapter,
            loop={
                "epoch_offset": self.epoch_offset,
                "elapsed_seconds": self.budget.elapsed_seconds,
                "guard": self.guard.state_dict(),
                "callbacks": {c.name: c.state_dict() for c in self.callbacks if c.name},
            },
            fingerprint_inputs=self.settings.fingerprint_inputs or {},
        )

    # ---- helpers ------------------------------------------------------------------------------

    def _announce(self) -> None:
        session, sampler = self.session, self.loader.sampler
        trainable = sum(int(np.size(v)) for v in session.adapter_state().values())
        lines = P.lora_config_lines(session.lora_config)
        lines += [P.lora_layers_line(len(session.adapters)), P.trainable_params_line(trainable)]
        if sampler.oversampled:
            lines.append(
                P.oversampling_line(
                    sampler.size, sampler.batch_size, sampler.samples_per_epoch, self.loader.dataset.random_crop
                )
            )
        lines += P.prompt_preview_lines(preview_prompts(self.loader))
        if self.resumed_from:
            lines.append(P.resume_line(self.global_step, self.epoch))
        lines += P.training_to_lines(self.settings.max_steps, self.global_step, self.settings.checkpoint_every)
        self.console.say(lines)

    def _plan_budget(self, batch) -> None:
        """A WSD budget needs its step count before the first step: time two probe steps on the
        first batch, then put the session back exactly as it was and freeze the plan."""
        if not self.budget.needs_plan:
            return
        state, adapter = self.session.state_dict(), self.session.adapter_state()
        times = []
        with self.budget.probing(self.settings.max_steps):
            for probe in range(2):
                started = time.perf_counter()
                self.session.step(batch_inputs(batch), np.random.default_rng([self.settings.seed, probe]))
                times.append(time.perf_counter() - started)
        self.session.load_adapter_state(adapter)
        self.session.load_state_dict(state)
        self.console.say(self.budget.freeze(times[-1], steps_done=self.global_step))


def preview_prompts(loader: BatchLoader, count: int = PREVIEW_PROMPTS) -> list[str]:
    """The prompts of the next `count` draws of the current epoch, exactly as training will see
    them (same random streams), without moving the sampler."""
    sampler, dataset = loader.sampler, loader.dataset
    epoch = sampler.epoch + (1 if sampler.position >= sampler.batches_per_epoch else 0)
    order = sampler.order(epoch)
    first = (sampler.position % max(sampler.batches_per_epoch, 1)) * sampler.batch_size
    prompts = []
    for draw in range(first, min(first + count, sampler.samples_per_epoch)):
        index = int(order[draw])
        info = dataset.sidecar(index)
        info.pop("padding_mask", None)
        info.setdefault("relpath", dataset.files[index].relpath)
        prompts.append(loader.prompt_fn(info, sampler.prompt_rng(epoch, draw)))
    return prompts


def _truncate_loss_log(path: Path, step: int) -> None:
    """Keep the records of steps before `step` (a killed run may have logged past its checkpoint)."""
    if not path.is_file():
        return
    records = P.read_loss_by_timestep(path)
    kept = [r for r in records if r[0] < step]
    if len(kept) == len(records) and path.stat().st_size == len(records) * P.LOSS_RECORD.size:
        return
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"".join(P.LOSS_RECORD.pack(*r) for r in kept))
