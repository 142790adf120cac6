"""One run of the `train` stage: params -> session, data, run directory, resume decision, loop,
the final adapter; and the smoke test.

    params = stage_params("train")   # sa3mlx.runtime.params: the declared keys only
    job = TrainJob.from_params(params["train"], base=params["model"]["base"], arc=params["model"]["arc"])
    sys.exit(job.run())          # or job.smoke()

The stage's outputs: `models/lora/<name>.safetensors` (the final adapter, DVC-cached, what
`demo` reads), `runs/<name>/` (checkpoints + resume states, `persist`) and `dvclive/train/`
(curves, `persist`). The run resumes from `runs/<name>/` only when the fingerprint of the
settings (all but max_steps / max_minutes) and of the stage's declared inputs matches; the
in-training demos (`train.demos`, the ARC model, the rendering code) are left out of it: changing
them reruns the stage, which resumes.
"""

from __future__ import annotations

import re
import sys
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import IO

from sa3mlx.data.dataset import BatchLoader, EpochSampler, PreEncodedDataset, encoded_share, find_latents
from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.lora.types import adapter_kind
from sa3mlx.models.config import ModelConfig
from sa3mlx.runtime.errors import ParamError
from sa3mlx.runtime.io import copy_atomic
from sa3mlx.runtime.layout import (
    DVCLIVE_TRAIN_DIR,
    LATENTS_DIR,
    LORA_DIR,
    MODEL_CONFIG_FILE,
    RUNS_DIR,
    converted_dir,
    source_model_dir,
)
from sa3mlx.runtime.layout import (
    svd_dir as svd_folder,
)
from sa3mlx.runtime.params import dvc_stages, fill_vars
from sa3mlx.runtime.precision import configure_device
from sa3mlx.runtime.schema import check_section, choice, flag, integer, mapping, text
from sa3mlx.train import progress as P
from sa3mlx.train.best import BestCheckpoint, BestSettings
from sa3mlx.train.demos import DemoSettings, TrainDemos
from sa3mlx.train.distributed import DistributedSettings, World, make_loop, run_rank, sync_start
from sa3mlx.train.guards import empty_prompt_lines
from sa3mlx.train.loop import LoopSettings, TrainingLoop
from sa3mlx.train.memory import plan_memory
from sa3mlx.train.metrics import TrainingMetrics
from sa3mlx.train.presets import DEFAULT_PRESET, PRESETS, TrainConfig, resolve
from sa3mlx.train.resume import fingerprint, fingerprint_inputs, load_resume, prepare_run, resume_files
from sa3mlx.train.runs import RunPaths
from sa3mlx.train.validation import ValidationSettings, Validator

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
STAGE_SPECS = {  # the train section's keys that are not TrainConfig fields
    "preset": choice(list(PRESETS), optional=True),
    "name": text(NAME_RE.pattern, optional=True),  # it names folders and files
    "smoke": flag(),
    "init_from": text(optional=True),
    "step_offset": integer(0, optional=True),
    "epoch_offset": integer(0, optional=True),
    "demos": mapping(optional=True),
    "validation": mapping(optional=True),
    "best": mapping(optional=True),
    "strict": flag(),
    "distributed": mapping(optional=True),
}
STAGE_KEYS = tuple(STAGE_SPECS)
# deps that only the in-training demos read: declared (DVC reruns the stage) but not fingerprinted (it resumes)
DEMO_DEPS = (
    "models/converted/${model.arc}",
    "sa3mlx/models/patching.py",
    "sa3mlx/models/same.py",
    "sa3mlx/models/same_chunked.py",
    "sa3mlx/models/same_layers.py",
    "sa3mlx/sample/audio_out.py",
    "sa3mlx/sample/demo_entries.py",
    "sa3mlx/sample/demo_models.py",
    "sa3mlx/sample/pictures.py",
    "sa3mlx/sample/render.py",
    "sa3mlx/sample/report.py",
    "sa3mlx/sample/samplers.py",
    "sa3mlx/sample/schedule.py",
)
BEST_SUFFIX = "-best"  # models/lora/<name>-best.safetensors
SMOKE_STEPS = (3, 3)  # steps before the save, steps after the resume
MEMORY_EXIT = 4  # the step would not fit in memory (stopped before the first step)


@dataclass
class TrainJob:
    cfg: TrainConfig
    base: str  # model.base
    name: str = "lora"
    preset: str | None = None
    smoke_mode: bool = False
    init_from: str | None = None  # a bare adapter to start from (fresh runs only)
    step_offset: int | None = None
    epoch_offset: int | None = None
    root: Path = Path(".")
    dvc_file: str = "dvc.yaml"
    arc: str | None = None  # model.arc: the ARC model of the in-training demos
    demos: DemoSettings = DemoSettings()
    validation: ValidationSettings = ValidationSettings()
    best: BestSettings = BestSettings()
    strict: bool = False  # fail on a prompt census over the limit instead of warning
    distributed: DistributedSettings = DistributedSettings()  # not fingerprinted: another world size resumes

    @classmethod
    def from_params(cls, params: dict, base: str, root: str | Path = ".", arc: str | None = None) -> TrainJob:
        stage = check_section("train", {k: params[k] for k in STAGE_KEYS if k in params}, STAGE_SPECS)
        overrides = {k: v for k, v in params.items() if k not in STAGE_KEYS}
        cfg = resolve(stage.get("preset"), overrides)
        job = cls(
            cfg,
            base,
            name=stage.get("name") or "lora",
            preset=stage.get("preset"),
            smoke_mode=bool(stage.get("smoke", False)),
            init_from=stage.get("init_from"),
            step_offset=stage.get("step_offset"),
            epoch_offset=stage.get("epoch_offset"),
            root=Path(root),
            arc=arc,
            demos=DemoSettings.from_params(stage.get("demos")),
            validation=ValidationSettings.from_params(stage.get("validation")),
            best=BestSettings.from_params(stage.get("best")),
            strict=bool(stage.get("strict", False)),
            distributed=DistributedSettings.from_params(stage.get("distributed")),
        )
        job.check_declared(params)
        job.distributed.check_batch(cfg.batch_size, cfg.grad_accum)
        return job

    # ---- paths ----------------------------------------------------------------------------------

    @property
    def model_dir(self) -> Path:
        return self.root / converted_dir(self.base)

    @property
    def svd_dir(self) -> Path:
        return self.root / svd_folder(self.base)

    @property
    def arc_dir(self) -> Path | None:
        return self.root / converted_dir(self.arc) if self.arc else None

    @property
    def latents(self) -> Path:
        return self.root / LATENTS_DIR

    @property
    def final_adapter(self) -> Path:
        return self.root / LORA_DIR / f"{self.name}.safetensors"

    @property
    def best_adapter(self) -> Path:
        return self.root / LORA_DIR / f"{self.name}{BEST_SUFFIX}.safetensors"

    @property
    def metrics_dir(self) -> Path:
        return self.root / DVCLIVE_TRAIN_DIR

    def run_paths(self, session: str | None = None) -> RunPaths:
        return RunPaths.create(self.root / RUNS_DIR, self.name, session)

    # ---- declared params and inputs (dvc.yaml) --------------------------------------------------

    def declared(self) -> dict | None:
        """The `train` stage of dvc.yaml with `${…}` filled in, or None without a dvc.yaml."""
        path = self.root / self.dvc_file
        if not path.is_file():
            return None
        stage = dvc_stages(path).get("train")
        if stage is None:
            return None
        return {"deps": [self._fill(d) for d in stage.get("deps", [])], "params": stage.get("params", [])}

    def _fill(self, text: str) -> str:
        values = {"model.base": self.base, "train.name": self.name}
        if self.arc:
            values["model.arc"] = self.arc
        return fill_vars(text, values)

    def check_declared(self, params: dict) -> None:
        """Every `train.<key>` read here must be a declared param of the stage, or DVC would not
        rerun it when that key changes."""
        declared = self.declared()
        if declared is None:
            return
        names = {p for p in declared["params"] if isinstance(p, str)}
        missing = sorted(f"train.{k}" for k in params if "train" not in names and f"train.{k}" not in names)
        if missing:
            raise ParamError(
                missing[0],
                f"unknown key (the train stage does not declare it under params: in {self.dvc_file}): remove it, or "
                "add it there too so a change reruns the stage",
                show_value=False,
            )

    def fingerprint_payload(self) -> dict:
        """The settings (all but the run length) and the digest of every input of the stage."""
        settings = {
            "train": self.cfg.fingerprint_dict(),
            "model.base": self.base,
            "name": self.name,
            "init_from": self.init_from,
            "step_offset": self.step_offset,
            "epoch_offset": self.epoch_offset,
            "validation_holdout": self.validation.fraction if self.validation.holds_out else None,
        }
        declared = self.declared()
        inputs = {LATENTS_DIR: self.latents, converted_dir(self.base).as_posix(): self.model_dir}
        if self.uses_svd():
            inputs[svd_folder(self.base).as_posix()] = self.svd_dir
        if declared is not None:
            demo_only = {self._fill(dep) for dep in DEMO_DEPS}
            inputs.update({dep: self.root / dep for dep in declared["deps"] if dep not in demo_only})
        if self.init_from:
            inputs["init_from"] = self.root / self.init_from
        return fingerprint_inputs(settings, inputs)

    def uses_svd(self) -> bool:
        return adapter_kind(self.cfg.adapter.adapter_type).xs

    # ---- building -------------------------------------------------------------------------------

    def build(self, cfg: TrainConfig | None = None):
        """(session, loader) for `cfg` (default: the job's); the held-out validation files are not in it."""
        from sa3mlx.train.session import TrainingSession

        cfg = cfg or self.cfg
        session = TrainingSession.build(
            self.model_dir, cfg, seed=cfg.seed, svd_dir=self.svd_dir if self.uses_svd() else None
        )
        train_files, _ = self.validation.split(find_latents(self.latents), cfg.seed)
        dataset = self._dataset(self.latents, cfg, cfg.random_crop, train_files)
        sampler = EpochSampler(len(dataset), cfg.batch_size, cfg.seed, drop_last=cfg.drop_last)
        return session, BatchLoader(dataset, sampler)

    def validation_dataset(self, cfg: TrainConfig | None = None) -> PreEncodedDataset | None:
        """The validation items (first crops): a folder of its own, or the files held out of data/latents."""
        cfg = cfg or self.cfg
        if not self.validation.on:
            return None
        if self.validation.folder is not None:
            return self._dataset(self.root / self.validation.folder, cfg, False, None)
        _, held_out = self.validation.split(find_latents(self.latents), cfg.seed)
        return self._dataset(self.latents, cfg, False, held_out)

    def _dataset(self, folder: Path, cfg: TrainConfig, random_crop: bool, files) -> PreEncodedDataset:
        crop = cfg.crop_length(self.model_config().variant)
        return PreEncodedDataset(folder, crop, random_crop, cfg.prompts, files=files)

    def callbacks(self, session, loader: BatchLoader, run: RunPaths, metrics: TrainingMetrics, console: P.Console):
        """Metrics, validation, the best checkpoint and the demos of a stage run, in that order."""
        console.say(empty_prompt_lines(loader.dataset, self.strict))
        validator = None
        if self.validation.on:
            validator = Validator(
                self.validation, session, self.validation_dataset(), self.cfg.seed, metrics, console.say
            )
        best = BestCheckpoint(self.best_adapter, self.best, session, validator is not None, say=console.say)
        if validator is not None:
            validator.listeners.append(best.on_validation)
        return [c for c in (metrics, validator, best) if c is not None] + self.demo_callbacks(session, run, console)

    # ---- the stage run --------------------------------------------------------------------------

    def run(self, out: IO | None = None) -> int:
        console = P.Console(out)
        if self.smoke_mode:
            return self.smoke(console.out)
        world = World.current(self.distributed)  # one process unless started by mlx.launch
        return run_rank(self, world, console) if world.size > 1 else self.train(console, world)

    def train(self, console: P.Console, world: World) -> int:
        """The run on rank 0 (the one that writes the outputs) or alone."""
        cfg, memory_lines = self.fit_memory()  # fits, or says what would, before anything is built or touched
        if cfg is None:
            return MEMORY_EXIT
        session, loader = self.build(cfg)  # every input read (a damaged one refused) before the run is touched
        if self.init_from:
            read_lora(self.root / self.init_from)
        self.validation_dataset()  # held-out files too
        payload = self.fingerprint_payload()
        key = fingerprint(payload)
        run = self.run_paths()
        choice, lines = prepare_run(run.root, key, payload)
        run.ensure_root()
        console.say([f"train: {self.describe()}", *lines])
        P.emit(memory_lines, sys.stderr)
        partial = encoded_share(self.latents)
        if partial:
            console.say(f"train: {partial}")
        settings = LoopSettings.from_config(self.cfg, fingerprint=key, fingerprint_inputs=payload)
        metrics = TrainingMetrics(self.metrics_dir, choice.state.step if choice.state else None)
        callbacks = self.callbacks(session, loader, run, metrics, console)
        loop = make_loop(world, session, loader, run, settings, callbacks=callbacks, console=console)
        if choice.state is not None:
            loop.restore(choice.state, choice.checkpoint)
        elif self.init_from:
            loop.start_from_adapter(self.root / self.init_from, self.step_offset, self.epoch_offset)
        saved_world = choice.state.loop.get("world_size", 1) if choice.state is not None else None
        sync_start(world, loop, saved_world, say=console.say)
        result = loop.run()
        if result.status == "done" and result.checkpoint is not None:
            copy_atomic(result.checkpoint, self.final_adapter)
            console.say(f"train: final adapter {self.final_adapter} (= {result.checkpoint.name})")
        elif result.status == "done":
            console.say("train: nothing was trained and the run has no checkpoint")
            return 1
        return result.exit_code

    def fit_memory(self) -> tuple[TrainConfig | None, list[str]]:
        """(the config with `grad_checkpoint` decided, the device and memory lines), or (None, lines)
        after saying on stderr what would fit when the step's estimated peak exceeds this machine's
        memory. Nothing is written: the run resumes. The caller prints the lines of a run that fits
        on stderr (stdout is the dashboard's) once its inputs have been read."""
        cfg, check = plan_memory(self.model_dir, self.cfg, self.cfg.crop_length(self.model_config().variant))
        lines = [configure_device(), *check.lines()]
        if not check.fits:
            P.emit(lines, sys.stderr)
            return None, lines
        return cfg, lines

    def demo_callbacks(self, session, run: RunPaths, console: P.Console) -> list[TrainDemos]:
        """The in-training demos (none when `train.demos.every` is 0 or there are no entries)."""
        if not self.demos.on:
            return []
        console.say(f"train: demos every {self.demos.every} steps ({len(self.demos.entries)} entries) -> {run.demos}")
        demos = TrainDemos(
            self.demos,
            session,
            run.demos,
            self.model_dir,
            self.arc_dir,
            svd_dir=self.svd_dir if self.uses_svd() else None,
            label=run.label,
            say=console.say,
        )
        return [demos]

    def model_config(self) -> ModelConfig:
        return ModelConfig.load(self.model_dir / MODEL_CONFIG_FILE)

    def model_config_path(self) -> Path:
        """The converted model's config, or before `convert` has run, the source snapshot's."""
        converted = self.model_dir / MODEL_CONFIG_FILE
        return converted if converted.is_file() else self.root / source_model_dir(self.base) / MODEL_CONFIG_FILE

    def resolved_config(self) -> dict:
        """What a run of this job really uses (`sa3mlx config train`): the preset with the params
        applied and the values left to the model filled in from its config, as plain JSON values."""
        path = self.model_config_path()
        model = ModelConfig.load(path)
        train = self.cfg.for_model(model)
        from_model = [
            f.name
            for f in fields(TrainConfig)
            if getattr(self.cfg, f.name) is None and getattr(train, f.name) is not None
        ]
        return {
            "preset": self.preset or DEFAULT_PRESET,
            "name": self.name,
            "model": {"base": self.base, "arc": self.arc, "config": str(path), "variant": model.variant},
            "train": train.as_dict(),
            "from_model_config": sorted(from_model),
            "stage": {
                "smoke": self.smoke_mode,
                "init_from": self.init_from,
                "step_offset": self.step_offset,
                "epoch_offset": self.epoch_offset,
                "strict": self.strict,
            },
            "validation": asdict(self.validation),
            "best": asdict(self.best),
            "demos": {"every": self.demos.every, "entries": len(self.demos.entries), "on": self.demos.on},
            "outputs": {
                "adapter": str(self.final_adapter),
                "best": str(self.best_adapter),
                "run": str(self.root / RUNS_DIR / self.name),
                "metrics": str(self.metrics_dir),
            },
        }

    def describe(self) -> str:
        cfg = self.cfg.for_model(self.model_config())
        masking = "train.mask_padding_attention" if self.cfg.mask_padding_attention is not None else "model config"
        return (
            f"preset {self.preset or 'underfit-dashboard'}, {cfg.adapter.adapter_type} r{cfg.adapter.rank}, "
            f"lr {cfg.lr:g} ({cfg.lr_schedule}), batch {cfg.batch_size}, crop {cfg.latent_crop_length}, "
            f"mask_padding_attention {str(cfg.mask_padding_attention).lower()} ({masking}), "
            f"to step {cfg.max_steps} on {self.base}; run {self.run_paths('x').root}"
        )

    # ---- smoke ----------------------------------------------------------------------------------

    def smoke(self, out: IO | None = None) -> int:
        """A few steps, save, a fresh session resumed from the save for a few more: the resumed
        adapter and state must equal an uninterrupted run's, byte for byte. Writes the adapter
        as the stage output; never touches runs/<name>/."""
        console = P.Console(out)
        before, after = SMOKE_STEPS
        fitted, memory_lines = self.fit_memory()
        if fitted is None:
            return MEMORY_EXIT
        P.emit(memory_lines, sys.stderr)
        cfg = replace(fitted, max_steps=before, checkpoint_every=before, keep_last=None)
        console.say(f"smoke: {before} steps, save, resume in a fresh session, {after} more ({self.describe()})")
        with tempfile.TemporaryDirectory(prefix="sa3mlx-smoke-") as tmp:
            straight = self._smoke_loop(cfg, Path(tmp) / "a", console)
            straight.run()
            saved = straight.last_checkpoint
            straight.settings = replace(straight.settings, max_steps=before + after)  # a second run, longer
            straight.run()
            resumed = self._smoke_loop(replace(cfg, max_steps=before + after), Path(tmp) / "b", console)
            resumed.restore(load_resume(resume_files(saved)[1]), saved)
            resumed.run()
            problems = _compare_runs(straight.last_checkpoint, resumed.last_checkpoint)
            if not problems:
                copy_atomic(resumed.last_checkpoint, self.final_adapter)
                copy_atomic(resumed.last_checkpoint, self.best_adapter)  # declared output; no selection here
        self.run_paths("x").ensure_root()  # the stage's persist output exists, untouched
        if problems:
            console.say(["smoke: FAILED: the resumed run differs from the uninterrupted one:", *problems])
            return 1
        console.say(
            f"smoke: OK: resumed at step {before}, {after} more steps; adapter and optimizer state "
            f"byte-identical to an uninterrupted run ({self.final_adapter})"
        )
        return 0

    def _smoke_loop(self, cfg: TrainConfig, save_dir: Path, console: P.Console) -> TrainingLoop:
        session, loader = self.build(cfg)
        run = RunPaths.create(save_dir, self.name, "00000000")
        return TrainingLoop(session, loader, run, LoopSettings.from_config(cfg), console=console)


def _compare_runs(a: Path, b: Path) -> list[str]:
    problems = []
    if a.name != b.name:
        problems.append(f"  checkpoint names differ: {a.name} vs {b.name}")
    elif a.read_bytes() != b.read_bytes():
        problems.append(f"  adapter files differ: {a.name}")
    state_a, state_b = load_resume(resume_files(a)[1]), load_resume(resume_files(b)[1])
    for key in sorted(set(state_a.adapter) | set(state_b.adapter)):
        if (
            key not in state_a.adapter
            or key not in state_b.adapter
            or state_a.adapter[key].tobytes() != state_b.adapter[key].tobytes()
        ):
            problems.append(f"  fp32 adapter tensor {key} differs")
    if resume_files(a)[0].read_bytes() != resume_files(b)[0].read_bytes():
        problems.append("  resume arrays (optimizer moments) differ")
    if (state_a.sampler, state_a.step) != (state_b.sampler, state_b.step):
        problems.append(f"  data position differs: {state_a.sampler} vs {state_b.sampler}")
    return problems
