"""What the underfit dashboard parses, byte for byte: the per-epoch tqdm bar, the console lines,
and `loss_by_timestep.bin`.

The bar is made and driven exactly as underfit's loop does (same tqdm arguments, same calls in
the same order), so each redraw after a step reads e.g.

    Step 2, Epoch 0:  33%|###3      | 2/6 [00:01<00:02, 1.9it/s, train/loss=0.123457, train/lr=1.000e-04,
    train/grad_norm=0.500000, train/lora_magnitude=12.345679]

(one console line, folded here), where `Step N` is the global step just completed, loss / grad norm
(post-clip) / adapter
magnitude are `{:.6f}` and lr is `{:.3e}` (the lr the next step will use).
"""

from __future__ import annotations

import contextlib
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from tqdm import tqdm

from sa3mlx.lora.config import LoRAConfig

LOSS_RECORD = struct.Struct("<Iff")  # pre-increment global step, mean shifted t, batch loss
LOSS_BY_TIMESTEP_FILE = "loss_by_timestep.bin"
FLUSH_EVERY = 10
TRAINING_DONE = "Training done"
SAVE_REQUESTED = "\n[SIGUSR1] Checkpoint save requested — will save after current step"


# ---- the per-epoch bar ------------------------------------------------------------------------


def step_description(global_step: int, epoch: int) -> str:
    return f"Step {global_step}, Epoch {epoch}"


def epoch_bar(
    batches: Iterable, global_step: int, epoch: int, total: int | None = None, file: IO | None = None, initial: int = 0
) -> tqdm:
    """The bar to iterate one epoch's batches with. `total` = batches in the epoch (needed when
    `batches` has no len); `initial` = batches of this epoch already done (a mid-epoch resume)."""
    return tqdm(
        batches,
        desc=step_description(global_step, epoch),
        total=total,
        initial=initial,
        mininterval=0,
        miniters=1,
        file=sys.stdout if file is None else file,
    )


def step_postfix(
    loss: float, lr: float, grad_norm: float | None = None, lora_magnitude: float | None = None
) -> dict[str, str]:
    """The postfix, in underfit's key order; the norms only when known."""
    metrics = {"train/loss": f"{loss:.6f}", "train/lr": f"{lr:.3e}"}
    if grad_norm is not None:
        metrics["train/grad_norm"] = f"{grad_norm:.6f}"
    if lora_magnitude is not None:
        metrics["train/lora_magnitude"] = f"{lora_magnitude:.6f}"
    return metrics


def report_step(
    bar: tqdm,
    global_step: int,
    epoch: int,
    loss: float,
    lr: float,
    grad_norm: float | None = None,
    lora_magnitude: float | None = None,
) -> None:
    """After a step: the metrics, then the description with the just-completed global step."""
    bar.set_postfix(step_postfix(loss, lr, grad_norm, lora_magnitude))
    bar.set_description(step_description(global_step, epoch))


@contextlib.contextmanager
def bar_paused(bar: tqdm):
    """Clear the bar while saving or rendering demos so their lines print cleanly; redraw after."""
    bar.clear()
    bar.disable = True
    try:
        yield
    finally:
        bar.disable = False
        bar.refresh()


# ---- console lines ----------------------------------------------------------------------------


def lora_config_lines(cfg: LoRAConfig) -> list[str]:
    """`LoRA config: rank=…, alpha=…, adapter_type=…` and the include / exclude lists when set."""
    alpha = cfg.metadata(0, 0)["alpha"]
    lines = [f"LoRA config: rank={cfg.rank}, alpha={alpha}, adapter_type={cfg.adapter_type}"]
    if cfg.include_patterns():
        lines.append(f"  include: {cfg.include_patterns()}")
    if cfg.exclude_patterns():
        lines.append(f"  exclude: {cfg.exclude_patterns()}")
    return lines


def lora_layers_line(count: int) -> str:
    return f"lora layers: {count}"


def trainable_params_line(count: int) -> str:
    return f"Trainable LoRA params: {count:,}"


def oversampling_line(files: int, batch_size: int, samples_per_epoch: int, random_crop: bool) -> str:
    return (
        f"Dataset has {files} file{'s' if files != 1 else ''} < batch_size {batch_size}; "
        f"oversampling with replacement → {samples_per_epoch} samples/epoch "
        f"({samples_per_epoch // batch_size} iters/epoch)"
        + ("" if random_crop else "  (tip: enable random_crop for real augmentation)")
    )


def resume_line(step_offset: int, epoch_offset: int) -> str:
    return f"Resuming from step offset {step_offset}, epoch offset {epoch_offset}"


def training_to_lines(max_steps: int, step_offset: int, save_every: int) -> list[str]:
    """`max_steps` is the absolute global target; a second line when nothing is left to train."""
    new_steps = max(0, max_steps - step_offset)
    lines = [
        f"Training to global step {max_steps} ({new_steps} new steps "
        f"from step_offset={step_offset}); save every {save_every}"
    ]
    if new_steps == 0:
        lines.append(f"step_offset ({step_offset}) is already at or past max_steps ({max_steps}); nothing to train.")
    return lines


def saved_line(filename: str, final: bool = False) -> str:
    return f"✓ Saved checkpoint -- {Path(filename).name}" + (" (final)" if final else "")


def prompt_preview_lines(prompts: list[str]) -> list[str]:
    lines = [f"Prompt preview ({len(prompts)} samples):"]
    return lines + [f"  [{i}] {p!r}" for i, p in enumerate(prompts)]


def emit(lines: str | list[str], file: IO | None = None) -> None:
    """Print console lines, flushed (the dashboard tails the log while training runs)."""
    for line in [lines] if isinstance(lines, str) else lines:
        print(line, file=sys.stdout if file is None else file, flush=True)


class Console:
    """The one way the training code writes text: `say(lines)` prints them flushed to `out`, with
    the epoch's bar (when one is showing) cleared and redrawn around them."""

    def __init__(self, out: IO | None = None):
        self.out = out or sys.stdout
        self.bar: tqdm | None = None

    def say(self, lines: str | list[str]) -> None:
        with self.bar_cleared():
            emit(lines, self.out)

    @contextlib.contextmanager
    def bar_cleared(self):
        """The bar cleared while the block runs (saves, demos, validation print cleanly)."""
        if self.bar is None:
            yield
            return
        with bar_paused(self.bar):
            yield


# ---- loss_by_timestep.bin ---------------------------------------------------------------------


class LossByTimestepLog:
    """Appends (step, mean shifted t, loss) records; opened lazily in append mode so resumes append;
    flushed when step % 10 == 0 and on close."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = None

    def write(self, step: int, t_mean: float, loss: float) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")
        self._file.write(LOSS_RECORD.pack(int(step), float(t_mean), float(loss)))
        if step % FLUSH_EVERY == 0:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> LossByTimestepLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_loss_by_timestep(path: str | Path) -> list[tuple[int, float, float]]:
    """The records of a loss_by_timestep.bin (whole records only, as the dashboard reads it)."""
    data = Path(path).read_bytes()
    usable = len(data) - len(data) % LOSS_RECORD.size
    return [LOSS_RECORD.unpack_from(data, i) for i in range(0, usable, LOSS_RECORD.size)]
