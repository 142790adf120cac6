"""Peak memory of a training step, estimated before the first one: the `grad_checkpoint` rule and
the fits-or-says-so check.

    need = estimate_peak_bytes(dit_cfg, crop, micro_batch, checkpoint, weight_bytes)
    budget = memory_budget()            # (bytes, where it comes from)

The model is `bench/memory.py`'s fit on the CPU (fp32): weights + what the backward keeps. Per
DiT block and sample it keeps `4·(ALPHA·L·E + BETA·P·H·L²)` bytes (L = crop + memory tokens,
P = 2 for differential attention); with checkpointing only `4·CKPT_KEPT·L·E` per block, plus
one block recomputed in full; either way the block in its backward holds `BLOCK_PEAK_MAPS` more
L×L maps per head and pair. Above `models.attention.CHUNK_BYTES` of scores the attention runs in
chunks with a backward of its own: then no map is kept, and the block in its backward holds about
`CHUNKS_IN_FLIGHT` chunks of scores per pair instead. Activations scale with the micro-batch
(batch / grad_accum).

Rule for `grad_checkpoint: null`: on when the estimate without it exceeds the budget's usable
share (`USABLE`), off otherwise (it costs one more forward per step).
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from sa3mlx.models.attention import CHUNK_BYTES, CHUNK_ROWS_BYTES
from sa3mlx.models.config import DiTConfig, ModelConfig
from sa3mlx.runtime.artifacts import verify_listed
from sa3mlx.runtime.errors import reading
from sa3mlx.runtime.layout import DIT_FILE, MODEL_CONFIG_FILE, T5GEMMA_FILE
from sa3mlx.runtime.precision import COMPUTE, STORED, on_cpu
from sa3mlx.train.presets import TrainConfig

GB = 1e9
# fitted by `python bench/memory.py --fit` (small-music blocks, fp32 CPU, batch 1): plain steps at d1/d2
# and crops 256/1300, checkpointed ones at d2/d4 and crop 1300
ALPHA = 71.0  # E-wide fp32 values kept per token per block for the backward (incl. the 4E feed-forward)
BETA = 0.53  # L×L attention maps kept per head per block (MLX's attention backward recomputes most)
CKPT_KEPT = 5.0  # E-wide values per token per checkpointed block (its input, the gradient flowing back)
# the block whose backward runs also holds ~this many L×L maps per head (and attention pair) at once:
# measured on medium at crop 4096 (bench/memory.py medium:2:4096:on, 12.3 GB); small shows less
BLOCK_PEAK_MAPS = 2.8
# chunked attention: score chunks (of CHUNK_ROWS_BYTES) alive at once in a block's backward, per pair:
# fitted to medium at crop 4096 so that the estimate is at or above bench/memory.py medium:{2,4,6}:4096:on:stored
CHUNKS_IN_FLIGHT = 18
OVERHEAD_BYTES = int(0.46 * GB)  # the runtime, compile buffers, the batch (measured intercept)
USABLE = 0.85  # share of the budget a run may plan to use (the OS, the data loader, fragmentation)
MEMORY_ENV = "SA3MLX_MEMORY_GB"  # overrides the detected budget (e.g. a shared machine's share)


@dataclass(frozen=True)
class StepShape:
    """What a step's memory depends on."""

    crop: int  # latents per example
    micro_batch: int  # examples per forward (batch_size / grad_accum)
    checkpoint: bool

    def describe(self) -> str:
        return f"crop {self.crop}, micro-batch {self.micro_batch}, grad_checkpoint {'on' if self.checkpoint else 'off'}"


def score_bytes(cfg: DiTConfig, crop: int) -> float:
    """One self-attention's fp32 score tensor, per sample."""
    length = crop + cfg.num_memory_tokens
    return 4.0 * cfg.num_heads * length * length


def chunked(cfg: DiTConfig, crop: int) -> bool:
    return score_bytes(cfg, crop) > CHUNK_BYTES


def block_activation_bytes(cfg: DiTConfig, crop: int) -> float:
    """What one block keeps for the backward, per sample, without checkpointing."""
    length = crop + cfg.num_memory_tokens
    pairs = 2 if cfg.differential else 1
    maps = 0.0 if chunked(cfg, crop) else BETA * pairs * score_bytes(cfg, crop)
    return 4.0 * ALPHA * length * cfg.embed_dim + maps


def backward_peak_bytes(cfg: DiTConfig, crop: int) -> float:
    """The attention maps (or chunks of them) one block's backward holds on top of what it keeps, per sample."""
    pairs = 2 if cfg.differential else 1
    if chunked(cfg, crop):
        return pairs * CHUNKS_IN_FLIGHT * min(CHUNK_ROWS_BYTES, score_bytes(cfg, crop))
    return BLOCK_PEAK_MAPS * pairs * score_bytes(cfg, crop)


def activation_bytes(cfg: DiTConfig, shape: StepShape) -> float:
    per_block = block_activation_bytes(cfg, shape.crop)
    peak = backward_peak_bytes(cfg, shape.crop)
    if shape.checkpoint:
        kept = 4.0 * CKPT_KEPT * (shape.crop + cfg.num_memory_tokens) * cfg.embed_dim
        return shape.micro_batch * (cfg.depth * kept + per_block + peak)
    return shape.micro_batch * (cfg.depth * per_block + peak)


def dit_parameter_count(cfg: DiTConfig) -> int:
    """Parameters of a DiT of `cfg` (built lazily: nothing is allocated)."""
    from sa3mlx.models.dit import DiT

    return sum(v.size for _, v in tree_flatten(DiT(cfg).parameters()))


def estimate_peak_bytes(cfg: DiTConfig, shape: StepShape, weight_bytes: float) -> float:
    """Peak memory of a step: `weight_bytes` (the loaded models) + activations + the fixed overhead."""
    return weight_bytes + activation_bytes(cfg, shape) + OVERHEAD_BYTES


def loaded_npz_bytes(path: str | Path, float_bytes: int | None, what: str = "weights") -> int:
    """Bytes an .npz takes once loaded, each floating array as `float_bytes` (None: as stored),
    from the array headers only."""
    total = 0
    path = verify_listed(path, what)  # damage is a one-line error here, before any estimate
    with reading(path, what), zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            with archive.open(name) as member:
                version = np.lib.format.read_magic(member)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(member)
            size = int(np.prod(shape, dtype=np.int64))
            itemsize = float_bytes if float_bytes and np.issubdtype(dtype, np.floating) else dtype.itemsize
            total += size * itemsize
    return total


def memory_budget() -> tuple[int, str]:
    """(bytes a run can use, where the figure comes from): $SA3MLX_MEMORY_GB, the GPU's memory,
    else the system's available memory."""
    override = os.environ.get(MEMORY_ENV)
    if override:
        try:
            return int(float(override) * GB), f"${MEMORY_ENV}"
        except ValueError:
            raise ValueError(f"${MEMORY_ENV}='{override}' is not a number of GB") from None
    import mlx.core as mx

    if not on_cpu():
        info = mx.device_info()
        for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
            if info.get(key):
                return int(info[key]), f"GPU {key}"
    return system_memory()


def system_memory() -> tuple[int, str]:
    """(available bytes, source): MemAvailable on Linux, else the physical memory."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def choose_checkpoint(cfg: DiTConfig, shape: StepShape, weight_bytes: float, budget: float) -> bool:
    """The `grad_checkpoint: null` rule: on iff the step without it would not fit."""
    plain = replace(shape, checkpoint=False)
    return estimate_peak_bytes(cfg, plain, weight_bytes) > USABLE * budget


def alternatives(cfg: DiTConfig, shape: StepShape, weight_bytes: float, budget: float, batch: int) -> list[str]:
    """Settings near `shape` whose estimate fits, as params.yaml lines (best first)."""
    fits = lambda s: estimate_peak_bytes(cfg, s, weight_bytes) <= USABLE * budget
    lines = []
    modes = sorted({shape.checkpoint, True})
    if not shape.checkpoint and fits(replace(shape, checkpoint=True)):
        lines.append("train.grad_checkpoint: true (same numbers, about a third slower)")
        modes = [False]  # checkpointing alone is enough: no need to shrink anything with it on
    for ckpt in modes:
        micro = shape.micro_batch // 2
        while micro >= 1 and not fits(replace(shape, micro_batch=micro, checkpoint=ckpt)):
            micro //= 2
        if 1 <= micro < shape.micro_batch and batch % micro == 0:
            extra = ", grad_checkpoint: true" if ckpt and not shape.checkpoint else ""
            lines.append(f"train.grad_accum: {batch // micro} (micro-batches of {micro}, same batch {batch}{extra})")
        crop = largest_fitting_crop(cfg, replace(shape, checkpoint=ckpt), weight_bytes, budget)
        if crop:
            extra = ", grad_checkpoint: true" if ckpt and not shape.checkpoint else ""
            lines.append(f"train.latent_crop_length: {crop} (or less{extra})")
    return list(dict.fromkeys(lines))


def largest_fitting_crop(cfg: DiTConfig, shape: StepShape, weight_bytes: float, budget: float) -> int | None:
    """The longest crop below `shape.crop` (a multiple of 16) whose estimate fits, or None."""
    low, high = 0, shape.crop // 16
    while low < high:
        mid = (low + high + 1) // 2
        if estimate_peak_bytes(cfg, replace(shape, crop=16 * mid), weight_bytes) <= USABLE * budget:
            low = mid
        else:
            high = mid - 1
    return 16 * low if 0 < 16 * low < shape.crop else None


@dataclass
class MemoryCheck:
    shape: StepShape
    need: float
    budget: float
    source: str
    options: list[str]
    base: str = ""  # how the frozen base is held, when that is worth saying

    @property
    def fits(self) -> bool:
        return self.need <= USABLE * self.budget

    def lines(self) -> list[str]:
        head = (
            f"memory: estimated peak {self.need / GB:.1f} GB for {self.shape.describe()}{self.base}; "
            f"budget {self.budget / GB:.1f} GB ({self.source}, {USABLE:.0%} usable)"
        )
        if self.fits:
            return [head]
        tail = [f"  {line}" for line in self.options] or ["  nothing smaller fits: use a machine with more memory"]
        return [
            head,
            f"memory: this step would not fit; stopping before the first step. Settings that fit "
            f"(or set ${MEMORY_ENV} if the budget is wrong):",
            *tail,
        ]


def check_memory(
    cfg: DiTConfig, shape: StepShape, weight_bytes: float, batch: int, budget: tuple[int, str]
) -> MemoryCheck:
    budget, source = budget
    need = estimate_peak_bytes(cfg, shape, weight_bytes)
    fitting = need <= USABLE * budget
    options = [] if fitting else alternatives(cfg, shape, weight_bytes, budget, batch)
    return MemoryCheck(shape, need, budget, source, options)


def model_weight_bytes(model_dir: str | Path, base_dtype: str = COMPUTE) -> int:
    """The converted DiT + conditioner and the prompt encoder as loaded: fp32 floats on the CPU, or the
    DiT as dit.npz stores it (`base_dtype` "stored"; the prompt encoder stays in its compute dtype)."""
    float_bytes = 4 if on_cpu() else None
    files = (
        (DIT_FILE, "DiT weights", None if base_dtype == STORED else float_bytes),
        (T5GEMMA_FILE, "T5Gemma weights", float_bytes),
    )
    return sum(loaded_npz_bytes(Path(model_dir) / name, size, what) for name, what, size in files)


def base_weight_bytes(base_dtype: str, checkpoint: bool, compute: int, stored: int) -> int:
    """What the weights take during a step. A stored (fp16) base saves only with checkpointing: without
    it, the fp32 copy each op computes with is kept for the backward too."""
    if base_dtype != STORED or not on_cpu():
        return compute
    return stored if checkpoint else stored + compute


def choose_base_dtype(cfg: DiTConfig, shape: StepShape, compute: int, budget: float) -> str:
    """The `base_dtype: null` rule: on the CPU, stored iff the checkpointed step would not fit with the
    base cast to fp32 at load (the stored form makes each op cast its weights: slower)."""
    if not on_cpu():
        return STORED  # GPUs compute in the stored dtype: the two are one
    tight = shape.checkpoint and estimate_peak_bytes(cfg, shape, compute) > USABLE * budget
    return STORED if tight else COMPUTE


def plan_memory(model_dir: str | Path, cfg: TrainConfig, crop: int) -> tuple[TrainConfig, MemoryCheck]:
    """(cfg with grad_checkpoint and base_dtype decided by the rules when null, the memory check of that step)."""
    dit = ModelConfig.load(Path(model_dir) / MODEL_CONFIG_FILE).dit
    compute = model_weight_bytes(model_dir)
    micro = max(1, cfg.batch_size // cfg.grad_accum)
    budget = memory_budget()
    checkpoint = cfg.grad_checkpoint
    if checkpoint is None:
        checkpoint = choose_checkpoint(dit, StepShape(crop, micro, False), compute, budget[0])
    shape = StepShape(crop, micro, checkpoint)
    base = cfg.base_dtype or choose_base_dtype(dit, shape, compute, budget[0])
    stored = model_weight_bytes(model_dir, STORED)
    check = check_memory(dit, shape, base_weight_bytes(base, checkpoint, compute, stored), cfg.batch_size, budget)
    if (
        not check.fits
        and base != STORED
        and checkpoint
        and estimate_peak_bytes(dit, shape, stored) <= USABLE * budget[0]
    ):
        check.options.insert(0, "train.base_dtype: stored (the fp16 base as dit.npz stores it: same numbers, slower)")
    if base == STORED and on_cpu():
        check.base = ", the base kept as stored (train.base_dtype: stored)"
    return replace(cfg, grad_checkpoint=checkpoint, base_dtype=base), check
