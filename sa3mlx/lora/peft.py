"""PEFT-style adapters (`adapter_config.json` + `adapter_model.safetensors`) as SA3 adapters.

PEFT keys are `base_model.model.<module>.lora_A.weight` (r, fan_in[, k]) and `.lora_B.weight`
(fan_out, r[, 1]), scale `lora_alpha / r` (`lora_alpha / √r` with `use_rslora`); with `use_dora`
a `lora_magnitude_vector` (fan_out) makes it DoRA over output rows, i.e. our `dora-rows`.
Module names are matched to SA3 checkpoint names (`model.transformer…`, `conditioners.…`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from sa3mlx.convert.checkpoint import CheckpointError, read_safetensors
from sa3mlx.lora.checkpoint import LoRAFile, check_readable_suffix
from sa3mlx.lora.targeting import COND_ROOT, DIT_ROOT, checkpoint_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PARTS = {
    ".lora_A.weight": "lora_A",
    ".lora_B.weight": "lora_B",
    ".lora_magnitude_vector.weight": "magnitude",
    ".lora_magnitude_vector": "magnitude",
}


def is_peft(path: str | Path) -> bool:
    """A PEFT folder, or a weights file with adapter_config.json beside it."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    return (folder / CONFIG_FILE).is_file() and (path.is_dir() or path.name == WEIGHTS_FILE)


def read_peft(path: str | Path, has_layer: Callable[[str], bool]) -> LoRAFile:
    """A PEFT adapter as a LoRAFile; `has_layer(name)` says whether a checkpoint-convention
    layer exists in the base (used to resolve the module names)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    weights = folder / WEIGHTS_FILE if path.is_dir() else path
    check_readable_suffix(weights)
    config = json.loads((folder / CONFIG_FILE).read_text())
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise CheckpointError(f"{folder}: PEFT '{field}' (per-layer rank/alpha) is not supported")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    if config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # so that alpha / rank = lora_alpha / √r
    tensors, _ = read_safetensors(weights)
    layers = _group(weights, tensors, has_layer)
    adapter_type = "dora-rows" if config.get("use_dora") else "lora"
    meta = {
        "rank": rank,
        "alpha": alpha,
        "adapter_type": adapter_type,
        "include": None,
        "exclude": None,
        "target_modules": config.get("target_modules"),
    }
    return LoRAFile(weights, meta, adapter_type, layers)


def _group(path: Path, tensors: dict[str, np.ndarray], has_layer) -> dict[str, dict[str, np.ndarray]]:
    layers: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        suffix = next((s for s in _PARTS if key.endswith(s)), None)
        if suffix is None:
            raise CheckpointError(f"{path}: '{key}' is not a PEFT LoRA key (lora_A / lora_B / magnitude)")
        name = sa3_layer_name(key[: -len(suffix)], has_layer)
        if name is None:
            raise CheckpointError(
                f"{path}: PEFT module '{key[: -len(suffix)]}' is not a layer of this base "
                "(trained for a different base?)"
            )
        flat = value.reshape(value.shape[0], -1).astype(np.float32)  # conv A (r, in, k) -> (r, in·k)
        layers.setdefault(name, {})[_PARTS[suffix]] = flat.reshape(-1) if _PARTS[suffix] == "magnitude" else flat
    return layers


def sa3_layer_name(module: str, has_layer) -> str | None:
    """The checkpoint-convention name of a PEFT module path, whichever root it was saved from
    (full SA3 model, the DiT wrapper, the bare DiT, MLX names)."""
    module = module.removeprefix(PEFT_PREFIX)
    candidates = [
        module,
        module.removeprefix("model."),
        module.removeprefix("conditioner."),
        DIT_ROOT + module,
        COND_ROOT + module,
    ]
    try:
        candidates.append(checkpoint_name(module.removeprefix(DIT_ROOT)))
    except (KeyError, ValueError):
        pass
    return next((c for c in candidates if c.startswith((DIT_ROOT, COND_ROOT)) and has_layer(c)), None)
