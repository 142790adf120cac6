"""The adapter types, their aliases, and the tensors each one trains.

Names follow the official `LoRAParametrization`: eight types plus the legacy `dora`, which
the official loader resolves to `dora-rows` or `dora-cols` from the stored magnitude shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sa3mlx.runtime.errors import UserError

ADAPTER_TYPES = ("lora", "dora-rows", "dora-cols", "bora", "lora-xs", "dora-rows-xs", "dora-cols-xs", "bora-xs")
LEGACY_DORA = "dora"
# Stability's MLX port spells these; they carry no shape information.
ALIASES = {"dora-xs": "dora-rows-xs", "xs": "lora-xs"}
# every tensor an adapter checkpoint may hold (U/V are never saved)
SAVED_PARAMS = ("lora_A", "lora_B", "magnitude", "magnitude_r", "magnitude_c", "M_xs")


class AdapterTypeError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class AdapterKind:
    name: str
    xs: bool  # U·M·Vᵀ with frozen SVD bases instead of B·A
    norm: str  # "none", "rows", "cols" or "both" (BoRA)

    @property
    def directional(self) -> bool:
        """DoRA/BoRA: normalised direction times a learned magnitude (hard bypass at strength 0)."""
        return self.norm != "none"

    def param_shapes(self, rank: int, fan_out: int, fan_in: int) -> dict[str, tuple]:
        """Trainable tensors and their shapes, in the official registration order."""
        shapes = {"M_xs": (rank, rank)} if self.xs else {"lora_A": (rank, fan_in), "lora_B": (fan_out, rank)}
        if self.norm == "rows":
            shapes["magnitude"] = (fan_out,)
        elif self.norm == "cols":
            shapes["magnitude"] = (fan_in,)
        elif self.norm == "both":
            shapes.update(magnitude_r=(fan_out,), magnitude_c=(fan_in,))
        return shapes

    def param_count(self, rank: int, fan_out: int, fan_in: int) -> int:
        return sum(int(np.prod(s)) for s in self.param_shapes(rank, fan_out, fan_in).values())


def adapter_kind(name: str) -> AdapterKind:
    """The kind of a canonical name or alias; bare `dora` means `dora-rows` (as the official class does)."""
    canonical = ALIASES.get(name, "dora-rows" if name == LEGACY_DORA else name)
    if canonical not in ADAPTER_TYPES:
        known = ", ".join(ADAPTER_TYPES + (LEGACY_DORA,) + tuple(ALIASES))
        raise AdapterTypeError(f"unknown adapter_type '{name}' (known: {known})")
    base = canonical.removesuffix("-xs")
    norm = {"lora": "none", "dora-rows": "rows", "dora-cols": "cols", "bora": "both"}[base]
    return AdapterKind(canonical, canonical.endswith("-xs"), norm)


def resolve_adapter_type(name: str, state: dict[str, np.ndarray] | None = None) -> str:
    """Canonical name; legacy `dora` by the first `.magnitude` tensor (keys sorted, as safetensors
    lists them): (1, fan_in) -> dora-cols, (fan_out, 1) -> dora-rows, 1-D or none -> dora-rows."""
    if name != LEGACY_DORA:
        return adapter_kind(name).name
    first = next((state[k] for k in sorted(state or {}) if k.endswith(".magnitude")), None)
    if first is not None and first.ndim == 2 and first.shape[0] == 1:
        return "dora-cols"
    return "dora-rows"


def squeeze_magnitudes(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Legacy files store DoRA magnitudes 2-D; the parametrisation holds them 1-D."""
    return {k: v.reshape(-1) if k.endswith(".magnitude") and v.ndim == 2 else v for k, v in state.items()}
