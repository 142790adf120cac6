"""A training session: the adapted model, its prompt encoder, optimizer and lr schedule, and
`step(batch, rng)` — one optimizer step on one batch (or on `grad_accum` micro-batches).

    session = TrainingSession.build("models/converted/tiny-base", resolve("underfit-loop", {"lr": 1e-4}), seed=42)
    out = session.step(batch, np.random.default_rng([seed, global_step]))   # StepOutput
    state = session.state_dict()          # optimizer moments, schedule, counters, fp32 adapters
    session.load_state_dict(state)        # continues bit-exactly (CPU)

Per step, on the host from `rng` in this order, for the whole batch: timesteps (sampler draws, then
the training shift with per-sample effective lengths when configured), noise, CFG dropout flags,
inpainting masks; only then is the batch cut into micro-batches (grad_accum, and ranks in a
data-parallel run), whose prompts go through the prompt-embedding cache. The device part is `StepCore`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.lora.bases import read_bases
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.inject import inject_adapters, load_lora_state
from sa3mlx.lora.layers import AdaptedLayer
from sa3mlx.models.conditioning import Conditioner, load_dit
from sa3mlx.models.config import ModelConfig
from sa3mlx.models.dit import DiT
from sa3mlx.models.prompt import PromptEncoder
from sa3mlx.models.prompt_cache import PromptCache
from sa3mlx.runtime.layout import DIT_FILE, MODEL_CONFIG_FILE
from sa3mlx.runtime.precision import STORED
from sa3mlx.sample.shifts import make_shift
from sa3mlx.train.objective import ObjectiveConfig, draw_cfg_dropout, draw_noise, random_inpaint_masks
from sa3mlx.train.optim import AdamWConfig, load_optimizer_state, make_adamw, make_schedule, optimizer_state_dict
from sa3mlx.train.presets import TrainConfig
from sa3mlx.train.step import TRAIN_MATERIALIZE, StepCore
from sa3mlx.train.timesteps import sample_timesteps, schedule_seq_len, shift_timesteps

STATE_VERSION = 1


@dataclass
class StepOutput:
    loss: float  # batch loss (NaN/inf allowed: then the update was skipped)
    grad_norm: float  # global adapter grad norm after clipping (NaN when skipped)
    lora_magnitude: float  # norm of all adapter tensors (incl. magnitudes) before the update, as underfit
    t_mean: float  # mean shifted timestep of the batch
    lr: float  # lr used for this step
    finite: bool  # False when the loss or grads were non-finite and the update was skipped


@dataclass
class Prepared:
    arrays: dict  # the StepCore batch fields but the prompt embeddings, every row (numpy)
    prompts: list[str]  # every row's prompt
    t: np.ndarray  # shifted timesteps [B]


class TrainingSession:
    def __init__(
        self,
        dit: DiT,
        cond: Conditioner,
        prompts: PromptEncoder,
        adapters: dict[str, AdaptedLayer],
        cfg: TrainConfig,
        model_config: ModelConfig,
        *,
        compile: bool = True,
    ):
        self.dit, self.cond, self.prompts, self.adapters = dit, cond, prompts, adapters
        cfg = cfg.for_model(model_config)
        self.cfg, self.model_config = cfg, model_config
        self.lora_config: LoRAConfig = cfg.adapter
        self.objective = ObjectiveConfig.from_train_config(cfg)
        self.shift = make_shift(model_config.distribution_shift)
        self.use_effective_length = cfg.use_effective_length_for_schedule
        self.optimizer = make_adamw(AdamWConfig(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay))
        options = dict(cfg.lr_schedule_options)
        if cfg.lr_schedule == "wsd":
            options["max_minutes"] = cfg.max_minutes
        self.schedule = make_schedule(cfg.lr_schedule, cfg.lr, options)
        dit.transformer.checkpoint_blocks = bool(cfg.grad_checkpoint)  # None (undecided) = off
        self.core = StepCore(dit, cond, adapters, self.objective, self.optimizer, cfg.grad_clip, compile)
        self.share = (0, 1)  # (rank, ranks): this process's micro-batches of each batch (`micro_batches`)
        self.updates = 0  # optimizer steps applied (the schedule's k)
        self.skipped = 0  # steps skipped for a non-finite loss or gradient

    @classmethod
    def build(
        cls,
        model_dir: str | Path,
        cfg: TrainConfig,
        seed: int,
        svd_dir: str | Path | None = None,
        *,
        compile: bool = True,
        cache: PromptCache | None = None,
    ) -> TrainingSession:
        """A converted model folder (dit.npz, t5gemma.npz, t5gemma/, model_config.json) with fresh
        adapters per `cfg.adapter` (lora_A init from `seed`; -xs bases from the svd stage's folder)."""
        model_dir = Path(model_dir)
        model_config = ModelConfig.load(model_dir / MODEL_CONFIG_FILE)
        dit, cond = load_dit(model_dir / DIT_FILE, model_config, STORED if cfg.base_dtype == STORED else None)
        mx.eval(dit.parameters(), cond.parameters())  # read the npz now: its lazy reads may outlive the stream
        prompts = PromptEncoder.from_converted(model_dir, cache=cache if cache is not None else PromptCache())
        bases = read_bases(svd_dir) if svd_dir is not None else None
        adapters = inject_adapters(
            dit, cond, cfg.adapter, bases, key=mx.random.key(int(seed)), materialize=TRAIN_MATERIALIZE, announce=False
        )
        return cls(dit, cond, prompts, adapters, cfg, model_config, compile=compile)

    # ---- one step --------------------------------------------------------------------------

    def prepare(self, batch, rng: np.random.Generator) -> Prepared:
        """Host draws of the whole (global) batch, in a plain 1-rank run's order, however the batch is
        then split: every rank and every micro-batch sees the rows' draws of the unsplit batch."""
        x0 = np.asarray(_field(batch, "latents"), np.float32)
        padding = np.asarray(_field(batch, "padding_mask"), bool)
        seconds = np.asarray(_field(batch, "seconds_total"), np.float64)
        size, _, length = x0.shape
        raw_t = sample_timesteps(self.cfg.timestep_sampler, size, rng, self.cfg.timestep_sampler_options)
        seq_len = schedule_seq_len(
            seconds,
            length,
            self.use_effective_length,
            self.model_config.sample_rate,
            self.model_config.autoencoder.downsampling_ratio,
        )
        t = shift_timesteps(raw_t, self.shift, seq_len)
        arrays = {
            "x0": x0,
            "noise": draw_noise(rng, x0.shape),
            "t": t,
            "seconds": seconds.astype(np.float32),
            "drop": draw_cfg_dropout(rng, size, self.objective.cfg_dropout_prob),
            "padding_mask": padding,
        }
        if self.objective.inpainting:
            arrays["inpaint_mask"] = random_inpaint_masks(
                rng, padding, self.objective.inpaint_mask_probabilities, mask_padding=self.objective.dit_padding_mask
            )
        return Prepared(arrays, list(_field(batch, "prompts")), t)

    def micro_batches(self, prepared: Prepared) -> list[dict]:
        """This process's StepCore micro-batches of a prepared batch: the batch is cut into ranks x
        grad_accum equal blocks of consecutive rows; rank r takes blocks r·grad_accum ... (r+1)·grad_accum − 1.
        So a run on W ranks computes exactly the micro-batches of a 1-rank run with grad_accum W."""
        rank, ranks = self.share
        accum = int(self.cfg.grad_accum)
        size = len(prepared.prompts)
        if size % (ranks * accum):
            split = f"{ranks} ranks x grad_accum={accum}" if ranks > 1 else f"grad_accum={accum}"
            raise ValueError(f"batch of {size} does not split into {split} equal micro-batches")
        rows = size // (ranks * accum)
        parts = []
        for block in range(rank * accum, (rank + 1) * accum):
            picked = slice(block * rows, (block + 1) * rows)
            part = {k: mx.array(v[picked]) for k, v in prepared.arrays.items()}
            part["prompt_hidden"], part["prompt_mask"] = self.prompts(prepared.prompts[picked])
            parts.append(part)
        return parts

    def step(self, batch, rng: np.random.Generator, lr: float | None = None) -> StepOutput:
        """One optimizer step; `lr` overrides the schedule (e.g. before a WSD plan is frozen)."""
        prepared = self.prepare(batch, rng)
        lr = self.schedule.lr(self.updates) if lr is None else float(lr)
        self.optimizer.learning_rate = lr
        loss, norm, finite, magnitude = self.core.run(self.micro_batches(prepared))
        finite = bool(finite.item())
        if finite:
            self.updates += 1
        else:
            self.skipped += 1
        t_mean = float(np.mean(prepared.t))
        return StepOutput(
            loss=float(loss.item()),
            grad_norm=float(norm.item()) if finite else float("nan"),
            lora_magnitude=float(magnitude.item()),
            t_mean=t_mean,
            lr=lr,
            finite=finite,
        )

    @property
    def next_lr(self) -> float:
        """The lr the next step will use (underfit logs this one as `train/lr`)."""
        return self.schedule.lr(self.updates)

    # ---- state -----------------------------------------------------------------------------

    def prompt_cache_stats(self) -> dict:
        cache = self.prompts.cache
        if cache is None:
            return {"hits": 0, "misses": 0, "hit_rate": 0.0}
        stats = cache.stats()
        return {"hits": stats.hits, "misses": stats.misses, "hit_rate": stats.hit_rate}

    def adapter_state(self) -> dict[str, np.ndarray]:
        """Adapter tensors (fp32) under their checkpoint keys."""
        return {k: np.array(v.astype(mx.float32)) for k, v in self.core.values.items()}

    def load_adapter_state(self, state: dict) -> None:
        load_lora_state(self.adapters, state)  # checks every layer, parameter and shape
        self.core.load_values(self.core.params.read())

    def state_dict(self) -> dict:
        """Everything a bit-exact resume needs besides the data position: optimizer moments,
        schedule state, counters and the fp32 adapters (checkpoints hold fp16)."""
        return {
            "version": STATE_VERSION,
            "optimizer": optimizer_state_dict(self.optimizer),
            "schedule": self.schedule.state_dict(),
            "updates": self.updates,
            "skipped": self.skipped,
            "adapters": self.adapter_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"training state version {state.get('version')} is not {STATE_VERSION}")
        if "adapters" in state:
            self.load_adapter_state(state["adapters"])
        load_optimizer_state(self.optimizer, state["optimizer"], self.core.values)
        self.schedule.load_state_dict(state["schedule"])
        self.updates, self.skipped = int(state["updates"]), int(state["skipped"])


def _field(batch, name: str):
    """A batch field from a dict or an object with attributes (sa3mlx.data.dataset.Batch)."""
    return batch[name] if isinstance(batch, dict) else getattr(batch, name)
