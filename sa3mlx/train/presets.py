"""The one table of training presets, and `resolve(preset, overrides)` -> TrainConfig.

Three conventions, each a complete set of defaults (adapter defaults live in `LoRAConfig`):

- `underfit-dashboard` (default): what a run launched from underfit's dashboard uses — dora-rows
  r16 with the dashboard excludes, trunc_logit_normal, AdamW lr 1e-4 betas (0.9, 0.95) wd 0.01,
  InverseLR (inv_gamma 1e6, power 0.5, warm-up 0.995), clip 1.0, random inpainting masks
  [segments 0.2, full 0.6, causal 0.2], batch 8.
- `underfit-loop`: underfit's loop without the dashboard — uniform t, torch AdamW defaults (lr
  has no default: give `lr`), no schedule, no clipping, all-ones inpaint mask with zero context
  and the loss on the padding mask, batch 1.
- `sa3-official`: the flags of SA3's `scripts/train_lora.py` — every layer adapted, trunc_logit_normal,
  AdamW lr 1e-4 betas (0.9, 0.95) wd 0.01, no schedule, no clipping, masks [0.1, 0.8, 0.1],
  context loss weight 1.0, effective-length schedule, crop 380 s
  (4091 latents), checkpoints every 500, full batches only.

In every preset `mask_padding_attention` and `use_effective_length_for_schedule` follow the model's
config (as underfit's loop and the official factory read them) unless a param sets them, and
`latent_crop_length` the model family; `TrainConfig.for_model` fills them in.

Every field can be overridden; an unknown key is an error naming the known ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace

from sa3mlx.data.prompts import PromptTemplate
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.models.config import ModelConfig
from sa3mlx.runtime.errors import ParamError
from sa3mlx.runtime.io import plain
from sa3mlx.runtime.precision import COMPUTE, STORED
from sa3mlx.runtime.schema import choice, field_specs, integer, number, options_from_params, positive, spec
from sa3mlx.train.optim import SCHEDULES, make_schedule
from sa3mlx.train.timesteps import SAMPLERS, check_sampler

DEFAULT_PRESET = "underfit-dashboard"
LOSS_NORMALIZATIONS = ("none", "timestep", "sample", "sample_channel")
CROP_BY_FAMILY = {"small": 1300, "medium": 4096}  # underfit's registry defaults, in latents
# left out of the resume fingerprint: a longer run resumes; max_minutes counts only under WSD;
# grad_checkpoint and base_dtype change memory, never numbers (a run stopped for memory resumes with them on)
NOT_FINGERPRINTED = ("max_steps", "max_minutes", "grad_checkpoint", "base_dtype")
# the frozen base in memory: as dit.npz stores it (fp16; every op still computes in fp32 on the CPU) or
# cast once to the compute dtype at load; the same numbers either way (sa3mlx/models/conditioning.py)
BASE_DTYPES = (STORED, COMPUTE)
WEIGHT = number(0)  # each of betas and inpaint_mask_probabilities


@dataclass(frozen=True)
class TrainConfig:
    # data
    latent_crop_length: int | None = field(default=None, metadata=spec(integer(1, optional=True)))  # None: by family
    random_crop: bool = True
    batch_size: int = field(default=1, metadata=spec(integer(1)))
    drop_last: bool = False
    seed: int = field(default=42, metadata=spec(integer(0)))
    prompts: PromptTemplate | None = None  # None: underfit's legacy tag prompt
    # adapter
    adapter: LoRAConfig = field(default_factory=LoRAConfig)
    # objective
    timestep_sampler: str = field(default="uniform", metadata=spec(choice(SAMPLERS)))
    timestep_sampler_options: dict = field(default_factory=dict)
    use_effective_length_for_schedule: bool | None = None  # None: as the model config says
    cfg_dropout_prob: float = field(default=0.1, metadata=spec(number(0, 1)))
    inpaint_mask_probabilities: tuple[float, float, float] | None = None  # None: all-ones mask, zero context
    mask_padding_attention: bool | None = None  # None: as the model config says
    mask_loss_weight: float = field(default=0.0, metadata=spec(number(0)))  # official kept-context term
    padding_loss_weight: float = field(default=0.0, metadata=spec(number(0)))  # underfit's padding-term weight
    loss_normalization: str = field(default="none", metadata=spec(choice(LOSS_NORMALIZATIONS)))
    loss_norm_eps: float = field(default=1e-6, metadata=spec(positive()))
    # optimisation
    lr: float | None = field(default=None, metadata=spec(positive(optional=True)))
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = field(default=1e-8, metadata=spec(positive()))
    weight_decay: float = field(default=0.01, metadata=spec(number(0)))
    lr_schedule: str = field(default="none", metadata=spec(choice(SCHEDULES)))
    lr_schedule_options: dict = field(default_factory=dict)
    max_minutes: float | None = field(default=None, metadata=spec(positive(optional=True)))  # `wsd`'s budget
    grad_clip: float | None = field(default=None, metadata=spec(number(0, optional=True)))
    grad_accum: int = field(default=1, metadata=spec(integer(1)))
    grad_checkpoint: bool | None = None  # recompute each DiT block in the backward; None: sa3mlx.train.memory's rule
    base_dtype: str | None = field(default=None, metadata=spec(choice(BASE_DTYPES, optional=True)))  # None: the rule
    # run length and saving
    max_steps: int = field(default=20000, metadata=spec(integer(1)))  # absolute global step target
    checkpoint_every: int = field(default=1000, metadata=spec(integer(1)))
    keep_last: int | None = field(default=None, metadata=spec(integer(1, optional=True)))  # None: keep every one
    max_nonfinite: int = field(default=10, metadata=spec(integer(1)))  # non-finite losses in a row before stopping

    def crop_length(self, variant: str) -> int:
        """The crop in latents: explicit, else the model family's default."""
        if self.latent_crop_length is not None:
            return self.latent_crop_length
        family = variant.split("-")[0]
        if family not in CROP_BY_FAMILY:
            problem = f"required: a '{variant}' model has no default (1300 small, 4096 medium)"
            raise ParamError("train.latent_crop_length", problem, show_value=False)
        return CROP_BY_FAMILY[family]

    def for_model(self, model: ModelConfig) -> TrainConfig:
        """What a run on `model` really uses: the fields left to the model (None) filled in from it."""
        effective = self.use_effective_length_for_schedule
        return replace(
            self,
            latent_crop_length=self.latent_crop_length or CROP_BY_FAMILY.get(model.variant.split("-")[0]),
            mask_padding_attention=_given(self.mask_padding_attention, model.mask_padding_attention),
            use_effective_length_for_schedule=_given(effective, model.use_effective_length),
        )

    def as_dict(self) -> dict:
        """Plain JSON-able values (nested configs as dicts, tuples as lists)."""
        return plain(dataclasses.asdict(self))

    def fingerprint_dict(self) -> dict:
        """What a resume must match: every field except the run length (and max_minutes unless WSD)."""
        values = self.as_dict()
        for name in NOT_FINGERPRINTED:
            if name == "max_minutes" and self.lr_schedule == "wsd":
                continue
            values.pop(name)
        return values


_DASHBOARD_OPTIM = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
PRESETS: dict[str, dict] = {
    "underfit-dashboard": {
        **_DASHBOARD_OPTIM,
        "batch_size": 8,
        "timestep_sampler": "trunc_logit_normal",
        "inpaint_mask_probabilities": (0.2, 0.6, 0.2),
        "lr_schedule": "inverse",
        "lr_schedule_options": {"inv_gamma": 1e6, "power": 0.5, "warmup": 0.995, "final_lr": 0.0},
        "grad_clip": 1.0,
    },
    "underfit-loop": {},  # the TrainConfig defaults are underfit's loop fallbacks
    "sa3-official": {
        **_DASHBOARD_OPTIM,
        "adapter": {"exclude": None},
        "timestep_sampler": "trunc_logit_normal",
        "inpaint_mask_probabilities": (0.1, 0.8, 0.1),
        "mask_loss_weight": 1.0,
        "use_effective_length_for_schedule": True,
        "latent_crop_length": (int(380.0 * 44100) // 4096),
        "checkpoint_every": 500,
        "max_steps": 10_000,
        "drop_last": True,
    },
}


def resolve(preset: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """The preset's defaults with `overrides` applied (nested `adapter` / `prompts` dicts merge)."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ParamError("train.preset", f"expected one of {', '.join(PRESETS)}", name)
    values = dict(PRESETS[name])
    overrides = dict(overrides or {})
    for picked, options in (("lr_schedule", "lr_schedule_options"), ("timestep_sampler", "timestep_sampler_options")):
        if picked in overrides and overrides[picked] != values.get(picked) and options not in overrides:
            values.pop(options, None)  # another schedule / sampler: its own defaults, not the preset's options
    for key, value in overrides.items():
        if key in ("adapter", "prompts") and isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    specs = field_specs(TrainConfig)
    unknown = sorted(set(values) - set(specs))
    if unknown:
        known = ", ".join(sorted(specs))
        raise ParamError(
            f"train.{unknown[0]}", f"unknown key (not a TrainConfig field); known: {known}", show_value=False
        )
    checked = {k: _coerce(k, specs[k].check(f"train.{k}", v)) for k, v in values.items()}
    cfg = replace(TrainConfig(), **checked)
    validate(cfg, name)
    return cfg


def _coerce(key: str, value):
    if key == "adapter":
        if isinstance(value, LoRAConfig):
            return value
        config = options_from_params(LoRAConfig, value or {}, "train.adapter")
        include, exclude = (tuple(v) if isinstance(v, list) else v for v in (config.include, config.exclude))
        return replace(config, include=include, exclude=exclude)
    if key == "prompts":
        if value is None or isinstance(value, PromptTemplate):
            return value
        try:
            return PromptTemplate.from_dict(value)
        except (ValueError, TypeError) as e:
            raise ParamError("train.prompts", str(e), show_value=False) from None
    if key in ("betas", "inpaint_mask_probabilities") and value is not None:
        return tuple(WEIGHT.check(f"train.{key}[{i}]", v) for i, v in enumerate(value))
    if key in ("timestep_sampler_options", "lr_schedule_options"):
        return dict(value or {})
    return value


def validate(cfg: TrainConfig, preset: str = "") -> None:
    where = f"train ({preset})" if preset else "train"
    if cfg.lr is None:
        problem = f"required: preset {preset or DEFAULT_PRESET}, like underfit's loop, has no default"
        raise ParamError("train.lr", problem, show_value=False)
    try:
        check_sampler(cfg.timestep_sampler, cfg.timestep_sampler_options)
    except ValueError as e:
        raise ParamError("train.timestep_sampler_options", str(e), show_value=False) from None
    if cfg.lr_schedule not in SCHEDULES:
        raise ValueError(f"{where}: unknown lr_schedule '{cfg.lr_schedule}'; expected one of {', '.join(SCHEDULES)}")
    options = dict(cfg.lr_schedule_options)
    if cfg.lr_schedule == "wsd":
        if not cfg.max_minutes:
            raise ParamError("train.max_minutes", "required by lr_schedule wsd (its plan)", show_value=False)
        options["max_minutes"] = cfg.max_minutes
    try:
        make_schedule(cfg.lr_schedule, cfg.lr, options)
    except (ValueError, TypeError) as e:
        raise ParamError("train.lr_schedule_options", str(e), show_value=False) from None
    if cfg.loss_normalization not in LOSS_NORMALIZATIONS:
        raise ValueError(
            f"{where}: unknown loss_normalization '{cfg.loss_normalization}'; "
            f"expected one of {', '.join(LOSS_NORMALIZATIONS)}"
        )
    probs = cfg.inpaint_mask_probabilities
    if probs is not None and (len(probs) != 3 or min(probs) < 0 or sum(probs) <= 0):
        raise ParamError(
            "train.inpaint_mask_probabilities", "expected 3 non-negative weights [segments, full, causal]", list(probs)
        )
    for name in ("batch_size", "grad_accum", "max_steps", "checkpoint_every", "max_nonfinite"):
        if int(getattr(cfg, name)) < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.latent_crop_length is not None and cfg.latent_crop_length < 1:
        raise ValueError(f"{where}: latent_crop_length must be >= 1")
    if not 0.0 <= cfg.cfg_dropout_prob <= 1.0:
        raise ValueError(f"{where}: cfg_dropout_prob must be in [0, 1]")
    if cfg.grad_clip is not None and cfg.grad_clip < 0:
        raise ValueError(f"{where}: grad_clip must be >= 0 (0 or null: off)")
    if cfg.keep_last is not None and cfg.keep_last < 1:
        raise ValueError(f"{where}: keep_last must be >= 1 or null")


def _given(value, model_value):
    return model_value if value is None else value


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
