"""Merge adapters into a converted DiT (`sa3mlx lora merge`): the npz that comes out loads with
`load_dit` like the base (same keys, same dtypes) and needs no adapter code at inference.

Two strength semantics, per adapter i with merged weight M_i(λ) (the effective weight at λ):
  TORCH_SEMANTICS (default): the live parametrisation, delta_i = M_i(λ_i) − W0. DoRA/BoRA are
      bypassed at λ = 0 and, for λ > 0, λ scales only the low-rank direction update (the
      magnitudes apply in full), exactly what the torch model and our live adapters compute.
  MLX_MERGE_RULE (`--mlx-strength-rule`): the official MLX merge, delta_i = λ_i·(M_i(1) − W0),
      a linear blend of the fully merged weight.
They agree at λ = 1 and, for every λ, for plain LoRA and lora-xs. Both write W0 + Σ_i delta_i
(deltas computed against the same W0, summed over adapters, in fp32, cast to W0's dtype).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.convert.checkpoint import CheckpointError, read_npz
from sa3mlx.lora.bases import layer_bases, read_bases
from sa3mlx.lora.checkpoint import LoRAFile, read_lora
from sa3mlx.lora.layers import LoRAShapeError
from sa3mlx.lora.maths import effective_weight_2d, mlx_weight_from_2d, mlx_weight_to_2d
from sa3mlx.lora.peft import is_peft, read_peft
from sa3mlx.lora.svd import svd_bases
from sa3mlx.lora.targeting import npz_weight_key
from sa3mlx.lora.types import adapter_kind
from sa3mlx.runtime.io import atomic_path, save_npz
from sa3mlx.runtime.layout import MODEL_CONFIG_FILE

TORCH_SEMANTICS = "torch"
MLX_MERGE_RULE = "mlx"


@dataclass
class MergeInput:
    adapter: LoRAFile
    strength: float = 1.0


def parse_lora_arg(text: str) -> tuple[Path, float]:
    """`FILE[:strength]` -> (path, strength); a tail that is not a number is part of the path."""
    head, sep, tail = text.rpartition(":")
    if sep:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(text), 1.0


def read_adapter(path: str | Path, base: dict[str, np.ndarray]) -> LoRAFile:
    """An SA3 adapter file, or a PEFT folder / adapter_model.safetensors, against this base."""
    if is_peft(path):
        return read_peft(path, lambda name: _has_weight(base, name))
    return read_lora(path)


def _has_weight(base: dict[str, np.ndarray], name: str) -> bool:
    try:
        return npz_weight_key(name) in base
    except KeyError:
        return False


def layer_delta(
    w0_2d: np.ndarray, adapter: LoRAFile, name: str, strength: float, rule: str, bases: dict[str, np.ndarray] | None
) -> np.ndarray:
    """fp32 (fan_out, fan_in) delta of one adapter on one layer under `rule`."""
    cfg = adapter.lora_config
    kind = adapter_kind(cfg.adapter_type)
    fan_out, fan_in = w0_2d.shape
    tensors = adapter.layers[name]
    for param, shape in kind.param_shapes(cfg.rank, fan_out, fan_in).items():
        got = tuple(np.shape(tensors.get(param, ())))
        if got != shape:
            raise LoRAShapeError(
                f"{adapter.path}: {name}: {param} has shape {got} but this base layer "
                f"({fan_out}x{fan_in}, rank {cfg.rank}) needs {shape} (trained for a different base?)"
            )
    p = {k: mx.array(v) for k, v in tensors.items()}
    if kind.xs:
        p["U"] = mx.array(bases["U"][:, : cfg.rank])
        p["V"] = mx.array(bases["V"][:, : cfg.rank])
    w0 = mx.array(w0_2d)
    if rule == TORCH_SEMANTICS:
        merged = effective_weight_2d(w0, kind, p, cfg.scale, strength)
        return np.array(merged - w0)
    if rule == MLX_MERGE_RULE:
        merged = effective_weight_2d(w0, kind, p, cfg.scale, 1.0)
        return np.array(strength * (merged - w0))
    raise ValueError(f"unknown strength rule '{rule}' (expected '{TORCH_SEMANTICS}' or '{MLX_MERGE_RULE}')")


def merge_arrays(
    base: dict[str, np.ndarray],
    inputs: list[MergeInput],
    rule: str = TORCH_SEMANTICS,
    svd: dict[str, dict[str, np.ndarray]] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, np.ndarray]:
    """base dit.npz arrays + adapters -> merged arrays (every key, every dtype as in `base`)."""
    deltas: dict[str, np.ndarray] = {}
    recomputed = []
    for item in inputs:
        xs = adapter_kind(item.adapter.lora_config.adapter_type).xs
        merged_keys = set()
        for name in item.adapter.layers:
            key = npz_weight_key(name)
            if key not in base:
                raise LoRAShapeError(
                    f"{item.adapter.path}: layer '{name}' ({key}) is not in the base (trained for a different base?)"
                )
            w0_2d = mlx_weight_to_2d(base[key].astype(np.float32))
            bases = None
            if xs:
                bases = layer_bases(svd, name, item.adapter.lora_config.rank)
                if bases is None:
                    bases = svd_bases(w0_2d, item.adapter.lora_config.rank)
                    recomputed.append(name)
            delta = layer_delta(w0_2d, item.adapter, name, item.strength, rule, bases)
            deltas[key] = deltas.get(key, 0) + delta
            merged_keys.add(key)
        say(check_merged_count(item.adapter, len(merged_keys)))
    if recomputed:
        say(
            f"-xs: recomputed the SVD bases of {len(recomputed)} layers from the base passed in (no svd file"
            f"{' entry' if svd else ''} for them); the result matches training only if it used the same bases"
        )
    merged = dict(base)
    for key, delta in deltas.items():
        w0 = base[key]
        w2 = mlx_weight_to_2d(w0.astype(np.float32)) + delta
        merged[key] = mlx_weight_from_2d(w2, w0.shape).astype(w0.dtype)
    return merged


def check_merged_count(adapter: LoRAFile, merged: int) -> str:
    """The report line of one adapter's merge; an error unless every adapted layer of the file was
    merged into a weight of its own (a merge of 0 of 169 layers must never pass in silence)."""
    adapted = len(adapter.layers)
    line = f"{adapter.path}: merged {merged} of {adapted} adapted layers"
    if adapted == 0 or merged != adapted:
        raise LoRAShapeError(f"{line}: every adapted layer of the file must be merged (trained for a different base?)")
    return line


def merge_files(
    base_path: str | Path,
    loras: list[str],
    out_path: str | Path,
    rule: str = TORCH_SEMANTICS,
    svd_dir: str | Path | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """`sa3mlx lora merge`: read, merge, write the npz atomically, and the base's model_config.json
    beside it (said so), so `load_dit(out)` works as it does on the base. A different config already
    there is never replaced: the merge is refused before anything is written."""
    base_path, out_path = Path(base_path), Path(out_path)
    if out_path.suffix != ".npz":
        raise CheckpointError(f"{out_path}: the merged DiT is written as .npz")
    config, beside = base_path.parent / MODEL_CONFIG_FILE, out_path.parent / MODEL_CONFIG_FILE
    if config.is_file() and beside.is_file() and beside.read_bytes() != config.read_bytes():
        raise CheckpointError(
            f"{beside} exists and is not the base's {MODEL_CONFIG_FILE} ({config}); the merged DiT needs the "
            "base's config beside it: write it into another folder (--out)"
        )
    base = read_npz(base_path)
    inputs = []
    for text in loras:
        path, strength = parse_lora_arg(text)
        adapter = read_adapter(path, base)
        inputs.append(MergeInput(adapter, strength))
        say(
            f"{path}: {adapter.config['adapter_type']} rank {adapter.config['rank']} alpha "
            f"{adapter.config['alpha']:g}, {len(adapter.layers)} layers, strength {strength:g}"
        )
    svd = read_bases(svd_dir) if svd_dir is not None else None
    merged = merge_arrays(base, inputs, rule, svd, say)
    save_npz(out_path, merged)
    if config.is_file() and not beside.is_file():
        with atomic_path(beside) as tmp:
            shutil.copyfile(config, tmp)
        say(f"{beside}: the base's {MODEL_CONFIG_FILE}, written beside the merged DiT so it loads like the base")
    rule_name = "torch (live parametrisation)" if rule == TORCH_SEMANTICS else "MLX merge rule"
    say(f"{out_path}: {len(inputs)} adapter(s) merged into {base_path.name} with {rule_name} strength semantics")
    return out_path
