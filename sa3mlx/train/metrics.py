"""Training curves for `dvc plots show`: one dvclive folder per run, kept across resumes.

Each step logs `train/loss`, `train/lr`, `train/grad_norm`, `train/lora_magnitude`,
`train/step_seconds` and `train/prompt_cache_hit_rate` at dvclive step = the global step just
completed (the `Step N` of the progress bar). A resumed run opens the folder with
`resume=True` and first drops the rows past its checkpoint's step (those were logged by the
interrupted process after its last save and are trained again), so each step appears once, and
rebuilds dvclive's summary (`metrics.json`) from what is left: the interrupted process may have
logged past its checkpoint, or been killed while dvclive wrote that file (not atomically).
A fresh run starts the folder over. `dvc.yaml` declares the folder's metrics and plots
(dvclive writes no dvc.yaml of its own).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from sa3mlx.runtime.io import atomic_path
from sa3mlx.train.contract import StepReport, TrainingCallback

METRIC_NAMES = (
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/lora_magnitude",
    "train/step_seconds",
    "train/prompt_cache_hit_rate",
)
PLOTS_SUBDIR = Path("plots") / "metrics"
SUMMARY = "metrics.json"  # dvclive's summary of the latest values (Live.metrics_file)


def _files_only_live(folder: Path, resume: bool):
    """A dvclive Live that only writes its files: no git/DVC repo probing (which fails in a repo
    without commits), no experiment saving, no Studio traffic. dvc.yaml declares the outputs."""
    from dvclive import Live  # imported here: only runs that log need it

    class FilesOnlyLive(Live):
        def _init_dvc(self):
            pass

        def _init_studio(self):
            self._studio_events_to_skip.update(("start", "data", "done"))

    return FilesOnlyLive(str(folder), resume=resume, report=None, save_dvc_exp=False, dvcyaml=None)


class TrainingMetrics(TrainingCallback):
    """The loop's metrics callback: each step's values at dvclive step = that global step; other
    callbacks (validation) log theirs through `log`."""

    def __init__(self, folder: str | Path, resume_step: int | None = None):
        """`resume_step` None: a fresh run (previous history removed); else keep rows up to it."""
        self.folder = Path(folder)
        if resume_step is not None:
            truncate_history(self.folder, resume_step)
            rebuild_summary(self.folder, resume_step)
        self.live = _files_only_live(self.folder, resume_step is not None)

    def on_step(self, report: StepReport) -> None:
        out = report.output
        values = {
            "train/loss": out.loss,
            "train/lr": report.lr,
            "train/grad_norm": out.grad_norm,
            "train/lora_magnitude": out.lora_magnitude,
            "train/step_seconds": report.seconds,
        }
        if report.prompt_cache_hit_rate is not None:
            values["train/prompt_cache_hit_rate"] = report.prompt_cache_hit_rate
        self.log(report.step, values)

    def on_run_end(self, status: str, step: int, checkpoint) -> None:
        self.close()

    def log(self, step: int, values: dict[str, float]) -> None:
        self.live.step = int(step)
        for name, value in values.items():
            value = float(value)
            self.live.log_metric(name, value if math.isfinite(value) else float("nan"))
        self.live.next_step()

    def close(self) -> None:
        self.live.end()

    def __enter__(self) -> TrainingMetrics:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_history(folder: str | Path, last_step: int) -> None:
    """Drop the rows with step > last_step from every plot file of a dvclive folder."""
    plots = Path(folder) / PLOTS_SUBDIR
    if not plots.is_dir():
        return
    for path in sorted(plots.rglob("*.tsv")):
        rows = list(csv.reader(io.StringIO(path.read_text()), delimiter="\t"))
        if not rows or "step" not in rows[0]:
            continue
        column = rows[0].index("step")
        kept = [rows[0]] + [r for r in rows[1:] if len(r) > column and int(r[column]) <= last_step]
        if len(kept) == len(rows):
            continue
        buffer = io.StringIO()
        csv.writer(buffer, delimiter="\t", lineterminator="\n").writerows(kept)
        with atomic_path(path) as tmp:
            tmp.write_text(buffer.getvalue())


def rebuild_summary(folder: str | Path, last_step: int) -> None:
    """dvclive's summary from the plot files: the latest value of every metric, and the step."""
    plots = Path(folder) / PLOTS_SUBDIR
    summary: dict = {}
    for path in sorted(plots.rglob("*.tsv")) if plots.is_dir() else []:
        name = path.relative_to(plots).with_suffix("").as_posix()
        rows = read_history(folder, name)
        if not rows:
            continue
        *parents, leaf = name.split("/")
        node = summary
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = rows[-1][1]
    summary["step"] = last_step
    Path(folder).mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(folder) / SUMMARY) as tmp:
        tmp.write_text(json.dumps(summary, indent=4))


def read_history(folder: str | Path, name: str) -> list[tuple[int, float]]:
    """(step, value) rows of one metric, e.g. `train/loss` (for tests and reports)."""
    path = Path(folder) / PLOTS_SUBDIR / f"{name}.tsv"
    rows = list(csv.reader(io.StringIO(path.read_text()), delimiter="\t"))
    column = rows[0].index(name.split("/")[-1])
    step = rows[0].index("step")
    return [(int(r[step]), float(r[column])) for r in rows[1:]]
