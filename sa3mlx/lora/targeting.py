"""Which layers get an adapter: the official include/exclude filters on checkpoint-convention
names (`model.transformer.layers.N…` for the DiT, `conditioners.seconds_total.embedder.embedding.1`
for the seconds embedder), and the adaptable layers of an SA3 model from its shape table.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from sa3mlx.convert.dit import (
    COND_KEYS,
    COND_PREFIX,
    dit_key_to_mlx,
    dit_key_to_torch,
    torch_cond_shapes,
    torch_dit_shapes,
)
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.types import adapter_kind
from sa3mlx.models.config import DiTConfig

DIT_ROOT = "model."  # checkpoint names of DiT layers: "model." + torch key without ".weight"
COND_ROOT = "conditioners."
_RANGE = re.compile(r"\[(\d+)-(\d+)\]")
# torch named_modules() order of the DiT's Linear/Conv1d layers (top level, then per block)
_TOP_ORDER = (
    "to_timestep_embed",
    "to_cond_embed",
    "to_global_embed",
    "transformer.layers.",
    "transformer.project_in",
    "transformer.project_out",
    "transformer.global_cond_embedder",
    "preprocess_conv",
    "postprocess_conv",
)
_BLOCK_ORDER = (
    "self_attn.to_qkv",
    "self_attn.to_out",
    "cross_attn.to_q",
    "cross_attn.to_kv",
    "cross_attn.to_out",
    "ff.ff.0.proj",
    "ff.ff.2",
    "to_local_embed.0",
    "to_local_embed.2",
)


def expand(pattern: str) -> list[str]:
    """Every `[a-b]` -> a..b inclusive (descending when b < a); several ranges: cartesian product."""
    parts = _RANGE.split(pattern)
    literals, ranges = parts[0::3], list(zip(parts[1::3], parts[2::3]))
    choices = [range(int(a), int(b) + 1) if int(a) <= int(b) else range(int(a), int(b) - 1, -1) for a, b in ranges]
    out = []
    for numbers in itertools.product(*choices):
        text = literals[0]
        for number, literal in zip(numbers, literals[1:]):
            text += str(number) + literal
        out.append(text)
    return out


def matches_any(name: str, patterns) -> bool:
    """A pattern matches when any of its expansions (after strip()) is a plain substring of name."""
    return any(e in name for p in patterns or () for e in expand(p.strip()))


def is_selected(name: str, include, exclude) -> bool:
    """Absent/null/empty include = every layer; exclude wins over include."""
    if include and not matches_any(name, include):
        return False
    return not (exclude and matches_any(name, exclude))


@dataclass(frozen=True)
class AdaptableLayer:
    name: str  # checkpoint convention
    fan_out: int
    fan_in: int  # in·k for a Conv1d
    kernel: int  # 0 for a Linear

    @property
    def is_conv(self) -> bool:
        return self.kernel > 0


def adaptable_layers(dit: DiTConfig, cond_dim: int) -> list[AdaptableLayer]:
    """Every Linear/Conv1d of the DiT, then the seconds embedder, in torch named_modules() order."""
    layers = [
        _layer(DIT_ROOT + key, shape)
        for key, shape in torch_dit_shapes(dit).items()
        if key.endswith(".weight") and len(shape) >= 2
    ]
    layers.sort(key=lambda layer: _module_rank(layer.name[len(DIT_ROOT) :]))
    for key, shape in torch_cond_shapes(cond_dim).items():
        if key.endswith(".weight") and len(shape) >= 2:
            layers.append(_layer(COND_ROOT + key[len(COND_PREFIX) :], shape))
    return layers


def _layer(key: str, shape: tuple) -> AdaptableLayer:
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    return AdaptableLayer(key.removesuffix(".weight"), shape[0], fan_in, shape[2] if len(shape) == 3 else 0)


def _module_rank(name: str) -> tuple:
    top = next(i for i, prefix in enumerate(_TOP_ORDER) if name.startswith(prefix))
    if _TOP_ORDER[top] != "transformer.layers.":
        return (top, 0, 0, name)
    index, _, rest = name[len("transformer.layers.") :].partition(".")
    return (top, int(index), _BLOCK_ORDER.index(rest), name)


def mlx_module_path(name: str) -> str | None:
    """The DiT module path in our MLX model (dit.npz names) of a checkpoint-convention layer name;
    None for the seconds embedder, which the MLX conditioner holds as plain arrays."""
    if not name.startswith(DIT_ROOT):
        return None
    return dit_key_to_mlx(name[len(DIT_ROOT) :] + ".weight").removesuffix(".weight")


def npz_weight_key(name: str) -> str:
    """The dit.npz key of a checkpoint-convention layer's weight (`cond.seconds_total_weight` for
    the seconds embedder)."""
    if name.startswith(DIT_ROOT):
        return mlx_module_path(name) + ".weight"
    torch_key = "conditioner." + name + ".weight"
    if torch_key not in COND_KEYS:
        raise KeyError(f"'{name}' is not a layer of an SA3 DiT or conditioner")
    return COND_KEYS[torch_key]


def checkpoint_name(mlx_path: str) -> str:
    """Inverse of mlx_module_path for DiT layers."""
    return DIT_ROOT + dit_key_to_torch(mlx_path + ".weight").removesuffix(".weight")


def select_layers(layers: list[AdaptableLayer], cfg: LoRAConfig) -> list[AdaptableLayer]:
    include, exclude = cfg.include_patterns(), cfg.exclude_patterns()
    return [layer for layer in layers if is_selected(layer.name, include, exclude)]


def count_adapter(layers: list[AdaptableLayer], cfg: LoRAConfig) -> tuple[int, int, int]:
    """(layers, checkpoint keys, trainable parameters) of cfg's adapter on these layers."""
    kind = adapter_kind(cfg.adapter_type)
    shapes = [kind.param_shapes(cfg.rank, layer.fan_out, layer.fan_in) for layer in layers]
    params = sum(kind.param_count(cfg.rank, layer.fan_out, layer.fan_in) for layer in layers)
    return len(layers), sum(len(s) for s in shapes), params


def summary_line(layers: list[AdaptableLayer], cfg: LoRAConfig) -> str:
    return format_summary(cfg, *count_adapter(layers, cfg))


def format_summary(cfg: LoRAConfig, n_layers: int, n_keys: int, n_params: int) -> str:
    return (
        f"{cfg.adapter_type} rank {cfg.rank} alpha {cfg.resolved_alpha:g}: "
        f"{n_layers} layers, {n_keys} keys, {n_params:,} parameters"
    )
