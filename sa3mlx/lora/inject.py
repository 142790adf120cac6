"""Adapters on a loaded DiT and Conditioner: swap the selected layers for adapter wrappers.

DiT layers are found by their MLX module path (`targeting.mlx_module_path`); the seconds
embedder, which the Conditioner holds as plain arrays, is wrapped as a Linear over the same
arrays and installed through the Conditioner's `seconds_linear` hook. After injection the
whole DiT and Conditioner are frozen except the adapter tensors (fp32).

    layers = inject_adapters(dit, cond, LoRAConfig())        # {checkpoint name: AdaptedLayer}
    set_strength(layers, 0.5)
    state = lora_state(layers)                                # checkpoint keys -> mx arrays
    layers = apply_checkpoint(dit, cond, "run-step=100-epoch=1.safetensors", strength=1.0)
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from sa3mlx.lora.bases import layer_bases
from sa3mlx.lora.checkpoint import KEY_RE, apply_lora, lora_key, read_lora
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.layers import AdaptedLayer, LoRAShapeError, wrap
from sa3mlx.lora.targeting import (
    AdaptableLayer,
    adaptable_layers,
    format_summary,
    is_selected,
    mlx_module_path,
    select_layers,
)
from sa3mlx.models.conditioning import Conditioner
from sa3mlx.models.dit import DiT

SECONDS_HOOK = "seconds_linear"  # the Conditioner attribute its seconds_embedding uses when set


def model_layers(dit: DiT, cond: Conditioner) -> list[AdaptableLayer]:
    """Every adaptable layer of this DiT + Conditioner, in torch registration order."""
    return adaptable_layers(dit.config, cond.seconds_total_weight.shape[0])


def inject_adapters(
    dit: DiT,
    cond: Conditioner,
    lora_config: LoRAConfig,
    svd_bases: dict[str, dict[str, np.ndarray]] | None = None,
    key: mx.array | None = None,
    *,
    materialize: bool = True,
    announce: bool = True,
) -> dict[str, AdaptedLayer]:
    """Wrap the layers `lora_config` selects; returns them by checkpoint name, in order.

    `svd_bases` (checkpoint name -> {"U", "V"}, e.g. from the svd stage) feed the -xs types; a
    layer without an entry gets the canonical SVD of its weight as loaded. `key` seeds the
    lora_A init (layer i uses the i-th split). Prints the summary line unless `announce=False`.
    """
    chosen = select_layers(model_layers(dit, cond), lora_config)
    layers = _inject(dit, cond, [layer.name for layer in chosen], lora_config, svd_bases, key, materialize)
    if announce:
        print(injected_summary(layers, lora_config))
    return layers


def _inject(
    dit: DiT, cond: Conditioner, names: list[str], cfg: LoRAConfig, svd_bases, key, materialize: bool
) -> dict[str, AdaptedLayer]:
    keys = mx.random.split(mx.random.key(0) if key is None else key, max(len(names), 2))
    dit.freeze()
    cond.freeze()
    layers = {}
    for i, name in enumerate(names):
        base = _base_layer(dit, cond, name)
        if isinstance(base, AdaptedLayer):
            raise ValueError(f"{name}: already has an adapter (stacking adapters is not supported)")
        # the Conditioner's own seconds Linear is x@Wᵀ + b, not nn.Linear's addmm
        extra = {"fused_bias": False} if mlx_module_path(name) is None else {}
        layer = wrap(
            base,
            cfg.adapter_type,
            cfg.rank,
            cfg.alpha,
            bases=layer_bases(svd_bases, name, cfg.rank),
            key=keys[i],
            materialize=materialize,
            **extra,
        )
        _install(dit, cond, name, layer)
        layers[name] = layer
    return layers


def _base_layer(dit: DiT, cond: Conditioner, name: str) -> nn.Module:
    path = mlx_module_path(name)
    if path is not None:
        return _get_path(dit, path)
    if SECONDS_HOOK in cond:
        return cond[SECONDS_HOOK]
    cond_dim, features = cond.seconds_total_weight.shape
    linear = nn.Linear(features, cond_dim)
    linear.weight, linear.bias = cond.seconds_total_weight, cond.seconds_total_bias
    return linear


def _install(dit: DiT, cond: Conditioner, name: str, layer: AdaptedLayer) -> None:
    path = mlx_module_path(name)
    if path is None:
        setattr(cond, SECONDS_HOOK, layer)
        return
    parent_path, _, last = path.rpartition(".")
    parent = _get_path(dit, parent_path)
    if isinstance(parent, list):
        parent[int(last)] = layer
    else:
        setattr(parent, last, layer)


def _get_path(root: nn.Module, path: str):
    node = root
    for part in path.split(".") if path else ():
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def set_strength(layers: dict[str, AdaptedLayer], strength: float) -> None:
    """The official `set_lora_strength`: every adapter at `strength` (DoRA/BoRA bypass at 0)."""
    for layer in layers.values():
        layer.strength = float(strength)


def lora_state(layers: dict[str, AdaptedLayer]) -> dict[str, mx.array]:
    """Adapter tensors (fp32) under their checkpoint keys `<name>.parametrizations.weight.0.<param>`."""
    return {
        lora_key(name, param): value for name, layer in layers.items() for param, value in layer.lora_state().items()
    }


def load_lora_state(layers: dict[str, AdaptedLayer], state: dict) -> None:
    """Set adapter tensors from checkpoint-keyed arrays (mx or numpy); every key must name an
    injected layer and every injected layer must get all its tensors, with exact shapes."""
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key, value in state.items():
        match = KEY_RE.match(key)
        if match is None or match.group(2) != "0":
            raise LoRAShapeError(f"'{key}' is not an adapter key '<layer>.parametrizations.weight.0.<param>'")
        name, _, param = match.groups()
        grouped.setdefault(name, {})[param] = np.asarray(
            value.astype(mx.float32) if isinstance(value, mx.array) else value, dtype=np.float32
        )
    unknown = sorted(set(grouped) - set(layers))
    if unknown:
        raise LoRAShapeError(
            f"adapter state has layers this model has no adapter on: {', '.join(unknown[:3])}"
            " (trained for a different base or with other include/exclude?)"
        )
    for name, layer in layers.items():
        layer.load_lora_state(grouped.get(name, {}), name)


def apply_checkpoint(
    dit: DiT,
    cond: Conditioner,
    path: str | Path,
    strength: float = 1.0,
    *,
    svd_bases: dict[str, dict[str, np.ndarray]] | None = None,
    exclude: list[str] | None = None,
    base_model: str | None = None,
    materialize: bool = True,
    announce: bool = True,
) -> dict[str, AdaptedLayer]:
    """Inject the adapters of an SA3 adapter file (its own type, rank, alpha) on exactly the
    layers it holds, load its tensors and set `strength`. `exclude` drops matching layers
    (e.g. ["seconds_total"]); a layer this model lacks or a shape that does not fit is an error
    naming the layer."""
    lora = read_lora(path)
    cfg = lora.lora_config
    known = {layer.name: layer for layer in model_layers(dit, cond)}
    for name in lora.layers:
        if name not in known:
            raise LoRAShapeError(
                f"{lora.path}: layer '{name}' is not an adaptable layer of this model (trained for a different base?)"
            )
    names = [name for name in known if name in lora.layers and is_selected(name, None, exclude)]
    layers = _inject(dit, cond, names, cfg, svd_bases, None, materialize)
    lora.layers = {name: lora.layers[name] for name in names}
    apply_lora(lora, layers, base_model)
    set_strength(layers, strength)
    if announce:
        print(f"{lora.path.name}: {injected_summary(layers, cfg)}, strength {strength:g}")
    return layers


def injected_summary(layers: dict[str, AdaptedLayer], cfg: LoRAConfig) -> str:
    """The summary line (layers, checkpoint keys, trainable parameters) of injected adapters."""
    states = [layer.lora_state() for layer in layers.values()]
    return format_summary(
        cfg, len(layers), sum(len(s) for s in states), sum(v.size for s in states for v in s.values())
    )
