"""Adapter checkpoints in the official SA3 format (what underfit writes and the SA3 loaders read).

Keys `<layer>.parametrizations.weight.0.<param>` for param in lora_A, lora_B, magnitude,
magnitude_r, magnitude_c, M_xs (never U/V), every tensor fp16, one metadata key `lora_config`
holding the JSON of rank, alpha, adapter_type, include, exclude, step, epoch[, base_model].
Files are `<run_label>-step=<S>-epoch=<E>.safetensors` in `<save_dir>/<name>/<8-hex>/checkpoints/`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

from sa3mlx.convert.checkpoint import PICKLE_SUFFIXES, CheckpointError, read_safetensors
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.layers import AdaptedLayer, LoRAShapeError
from sa3mlx.lora.types import SAVED_PARAMS, resolve_adapter_type, squeeze_magnitudes
from sa3mlx.runtime.errors import reading
from sa3mlx.runtime.io import atomic_path

METADATA_KEY = "lora_config"
KEY_RE = re.compile(r"^(.+)\.parametrizations\.weight\.(\d+)\.(" + "|".join(SAVED_PARAMS) + r")$")


def lora_key(layer: str, param: str, index: int = 0) -> str:
    return f"{layer}.parametrizations.weight.{index}.{param}"


def run_label(name: str) -> str:
    """A dashboard run id `<slug>-<YYYYmmddHHMMSS>` without its timestamp."""
    return re.sub(r"-\d{14}$", "", name)


def checkpoint_file_name(label: str | None, step: int, epoch: int) -> str:
    stem = f"step={step}-epoch={epoch}"
    return f"{label}-{stem}.safetensors" if label else f"{stem}.safetensors"


def session_dir(save_dir: str | Path, name: str, session: str | None = None) -> Path:
    """`<save_dir>/<name>/<8-hex>/checkpoints/`: a new random session per process unless given."""
    return Path(save_dir) / name / (session or uuid.uuid4().hex[:8]) / "checkpoints"


def lora_state_dict(layers: dict[str, AdaptedLayer]) -> dict[str, np.ndarray]:
    """Checkpoint tensors (fp16) of named adapted layers."""
    return {
        lora_key(name, param): np.array(value.astype(mx.float32)).astype(np.float16)
        for name, layer in layers.items()
        for param, value in layer.lora_state().items()
    }


def save_lora(
    path: str | Path,
    layers: dict[str, AdaptedLayer],
    cfg: LoRAConfig,
    step: int,
    epoch: int,
    base_model: str | None = None,
) -> Path:
    """Write the checkpoint atomically; same tensors and config give the same bytes."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: adapter checkpoints are written as .safetensors")
    metadata = {METADATA_KEY: json.dumps(cfg.metadata(step, epoch, base_model))}
    with atomic_path(path) as tmp:
        save_file(lora_state_dict(layers), tmp, metadata=metadata)
    return path


@dataclass
class LoRAFile:
    path: Path
    config: dict  # lora_config with alpha/include/exclude back-filled, adapter_type resolved
    stored_adapter_type: str  # as written (legacy "dora" before resolution)
    layers: dict[str, dict[str, np.ndarray]]  # layer name -> param -> fp32 tensor (magnitudes 1-D)

    @property
    def lora_config(self) -> LoRAConfig:
        return LoRAConfig.from_metadata(self.config)


def check_readable_suffix(path: Path) -> None:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{path}: {path.suffix} adapter files are pickles (they can run code) and are "
            "not loaded; convert it to .safetensors with the official SA3 tools first"
        )
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path}: not a .safetensors adapter file")


def read_lora(path: str | Path) -> LoRAFile:
    """Read an adapter checkpoint (ours, underfit's, SA3's), resolving legacy `dora`."""
    path = Path(path)
    check_readable_suffix(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    with reading(path, "adapter"):
        tensors, metadata = read_safetensors(path)
    if METADATA_KEY not in metadata:
        raise CheckpointError(f"{path}: no '{METADATA_KEY}' metadata (not an SA3 adapter checkpoint)")
    try:
        config = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: '{METADATA_KEY}' is not valid JSON ({e})") from None
    if not isinstance(config, dict) or "rank" not in config or "adapter_type" not in config:
        raise CheckpointError(f"{path}: '{METADATA_KEY}' needs at least 'rank' and 'adapter_type'")
    state = {k: v for k, v in tensors.items() if KEY_RE.match(k)}
    if not state:
        raise CheckpointError(f"{path}: no adapter tensors (keys like '<layer>.parametrizations.weight.0.lora_A')")
    for field, default in (("alpha", config["rank"]), ("include", None), ("exclude", None)):
        config.setdefault(field, default)
    stored = config["adapter_type"]
    config["adapter_type"] = resolve_adapter_type(stored, state)
    return LoRAFile(path, config, stored, _group_by_layer(path, squeeze_magnitudes(state)))


def _group_by_layer(path: Path, state: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    layers: dict[str, dict[str, np.ndarray]] = {}
    for key in sorted(state):
        name, index, param = KEY_RE.match(key).groups()
        if index != "0":
            raise CheckpointError(f"{path}: {key}: stacked adapter index {index}; a file holds index 0 only")
        layers.setdefault(name, {})[param] = state[key].astype(np.float32)
    return layers


def apply_lora(lora: LoRAFile, layers: dict[str, AdaptedLayer], base_model: str | None = None) -> None:
    """Load the file's tensors into the named adapted layers; any layer, type, rank or shape that
    does not fit (or a different `base_model`) is an error naming it."""
    stored_base = lora.config.get("base_model")
    if base_model and stored_base and stored_base != base_model:
        raise CheckpointError(f"{lora.path}: trained for base model '{stored_base}', not '{base_model}'")
    for name, tensors in lora.layers.items():
        layer = layers.get(name)
        if layer is None:
            raise LoRAShapeError(
                f"{lora.path}: layer '{name}' is not an adapted layer of this model (trained for a different base?)"
            )
        if layer.kind.name != lora.config["adapter_type"]:
            raise LoRAShapeError(
                f"{lora.path}: layer '{name}' is {layer.kind.name} here but {lora.config['adapter_type']} in the file"
            )
        layer.load_lora_state(tensors, f"{lora.path}: {name}")
