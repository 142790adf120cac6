"""In-training demos (params `train.demos`): the demo renderer, called by the training loop at
step 0 of a fresh run and every `every` steps, into the run's `demos/` folder.

    settings = DemoSettings.from_params(params["train"]["demos"])    # every: 0 = off
    demos = TrainDemos(settings, session, run.demos, base_dir, arc_dir, label=run.label, say=console.say)
    TrainingLoop(..., callbacks=[demos])

Base demos render with the session's own adapted model (live, at each entry's strength); ARC
demos merge the adapter of that step (the checkpoint just saved, else a temporary copy) into the
ARC weights. Models loaded for a render are released after it. A render reads the adapters and
sets their strength for the duration of each demo only, draws from its own seeded keys and
encodes prompts outside the training prompt cache, so the run stays bit-exact with demos on or
off. Rendering is idempotent (`demo_<i>_<step:08d>.*` already there are kept), so a resumed run
fills in what a killed one left out. A failed render is reported and training goes on.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sa3mlx.lora.checkpoint import save_lora
from sa3mlx.models.prompt import PromptEncoder
from sa3mlx.sample.demo_entries import DemoEntry, parse_entries
from sa3mlx.sample.demo_models import DemoModels, LiveModel
from sa3mlx.sample.render import RenderOptions, render_demos
from sa3mlx.train.contract import StepReport, TrainingCallback
from sa3mlx.train.progress import emit

KEYS = ("every", "entries", "defaults", "baselines", "tail_seconds", "wav", "decode_chunk", "decode_overlap")


@dataclass(frozen=True)
class DemoSettings:
    every: int = 0  # steps between renders; 0: off
    entries: tuple[DemoEntry, ...] = ()
    baselines: bool = True  # each entry once at strength 0 too (baseline_<i>.*, rendered once)
    options: RenderOptions = field(default_factory=RenderOptions)

    @classmethod
    def from_params(cls, params: dict | None) -> DemoSettings:
        """`train.demos`: every, entries (as `demo.entries`), defaults, baselines, tail_seconds, wav,
        decode_chunk, decode_overlap. Entries are checked now, before any training."""
        params = dict(params or {})
        unknown = sorted(set(params) - set(KEYS))
        if unknown:
            raise ValueError(f"train.demos: unknown key(s) {unknown}; known: {list(KEYS)}")
        every = int(params.get("every") or 0)
        if every < 0:
            raise ValueError(f"train.demos.every must be >= 0 (0: off), got {every}")
        entries = tuple(parse_entries(params.get("entries") or [], params.get("defaults")))
        return cls(every, entries, bool(params.get("baselines", True)), RenderOptions.from_params(params))

    @property
    def on(self) -> bool:
        return self.every > 0 and bool(self.entries)

    @property
    def needs_arc(self) -> bool:
        return any(entry.arc for entry in self.entries)


class TrainDemos(TrainingCallback):
    """The loop's demo callback: at the start of a fresh run and every `every` steps."""

    def __init__(
        self,
        settings: DemoSettings,
        session,
        out_dir: str | Path,
        base_dir: str | Path,
        arc_dir: str | Path | None = None,
        *,
        svd_dir: str | Path | None = None,
        label: str = "adapter",
        say: Callable[[str], None] = emit,
    ):
        if settings.needs_arc and (arc_dir is None or not Path(arc_dir).is_dir()):
            raise ValueError(
                f"train.demos has ARC entries but the ARC model folder {arc_dir} is missing "
                "(model.arc, converted by the convert stage)"
            )
        self.settings, self.session, self.out_dir = settings, session, Path(out_dir)
        self.label, self.say = label, say
        live = LiveModel(session.dit, session.cond, session.adapters, uncached(session.prompts))
        self.models = DemoModels(base_dir, arc_dir if settings.needs_arc else None, svd_dir=svd_dir, live=live, say=say)
        self.rendered: list[int] = []  # steps rendered by this callback (for tests and logs)

    def due(self, step: int, starting_fresh: bool = False) -> bool:
        """Every `every` steps; also the first step of a fresh run (0, or a bare adapter's offset)."""
        return self.settings.on and (step % self.settings.every == 0 or starting_fresh)

    def on_run_start(self, step: int, fresh: bool) -> None:
        if self.due(step, fresh):
            self.render_step(step, None)

    def on_step(self, report: StepReport) -> None:
        if not report.stopping and self.due(report.step):
            self.render_step(report.step, report.checkpoint)

    def render_step(self, step: int, checkpoint: Path | None) -> None:
        try:
            with tempfile.TemporaryDirectory(prefix="sa3mlx-demo-adapter-") as tmp:
                adapter = checkpoint or save_lora(
                    Path(tmp) / f"{self.label}-step={step}.safetensors",
                    self.session.adapters,
                    self.session.lora_config,
                    step,
                    0,
                )
                summary = self.render(step, adapter)
        except Exception as e:  # noqa: BLE001 (a demo must never end a long run)
            self.say(f"demos at step {step} failed ({type(e).__name__}: {e}); training continues")
            return
        self.rendered.append(step)
        self.say(f"{summary.line()} (step {step}, {self.out_dir})")

    def render(self, step: int, adapter: Path):
        return render_demos(
            self.out_dir,
            step,
            self.settings.entries,
            self.models,
            [adapter],
            baselines=self.settings.baselines,
            options=self.settings.options,
            release=True,
            say=self.say,
        )


def uncached(prompts: PromptEncoder | None) -> PromptEncoder | None:
    """The same encoder without the training prompt cache (its hit rate is a training metric)."""
    if prompts is None:
        return None
    return PromptEncoder(prompts.encoder, prompts.tokenizer, prompts.weights_id, cache=None)
