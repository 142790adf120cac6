"""What to adapt and how: the adapter settings a run trains with and writes into `lora_config`.

Defaults are underfit's dashboard run (dora-rows, rank 16, alpha = rank, no include, the nine
dashboard exclude patterns; the seconds_total embedder adapted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sa3mlx.lora.types import ADAPTER_TYPES, ALIASES, LEGACY_DORA, adapter_kind
from sa3mlx.runtime.schema import choice, integer, positive, spec, texts

# the dashboard's default exclude list, in its order
DEFAULT_EXCLUDE = (
    "to_timestep_embed",
    "to_cond_embed",
    "to_global_embed",
    "to_local_embed",
    "global_cond_embedder",
    "project_in",
    "project_out",
    "preprocess_conv",
    "postprocess_conv",
)
SPELLINGS = (*ALIASES, LEGACY_DORA)  # other names `adapter_kind` reads as one of ADAPTER_TYPES
# SA3's documented filter for keeping the seconds_total embedder frozen
CONDITIONER_EXCLUDE = "seconds_total"


@dataclass(frozen=True)
class LoRAConfig:
    adapter_type: str = field(
        default="dora-rows", metadata=spec(choice(ADAPTER_TYPES + tuple(ALIASES) + (LEGACY_DORA,)))
    )
    rank: int = field(default=16, metadata=spec(integer(1)))
    alpha: float | None = field(default=None, metadata=spec(positive(optional=True)))  # None: alpha = rank (an int)
    include: tuple[str, ...] | None = field(default=None, metadata=spec(texts(optional=True)))  # None/empty: all
    exclude: tuple[str, ...] | None = field(default=DEFAULT_EXCLUDE, metadata=spec(texts(optional=True)))
    adapt_conditioner: bool = True  # False adds "seconds_total" to exclude

    def __post_init__(self):
        object.__setattr__(self, "adapter_type", adapter_kind(self.adapter_type).name)
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")

    @property
    def resolved_alpha(self) -> float:
        return self.rank if self.alpha is None else self.alpha

    @property
    def scale(self) -> float:
        return self.resolved_alpha / self.rank

    def include_patterns(self) -> list[str] | None:
        """None = no filter (an empty list is no filter too; `null` is what gets written)."""
        return list(self.include) if self.include else None

    def exclude_patterns(self) -> list[str] | None:
        patterns = list(self.exclude or ())
        if not self.adapt_conditioner and CONDITIONER_EXCLUDE not in patterns:
            patterns.append(CONDITIONER_EXCLUDE)
        return patterns if patterns or self.exclude is not None else None

    def metadata(self, step: int, epoch: int, base_model: str | None = None) -> dict:
        """The `lora_config` header object, keys in underfit's order; alpha an int when defaulted,
        a float when set (as the dashboard writes it); base_model only when known."""
        meta = {
            "rank": self.rank,
            "alpha": self.rank if self.alpha is None else float(self.alpha),
            "adapter_type": self.adapter_type,
            "include": self.include_patterns(),
            "exclude": self.exclude_patterns(),
            "step": int(step),
            "epoch": int(epoch),
        }
        if base_model:
            meta["base_model"] = base_model
        return meta

    @classmethod
    def from_metadata(cls, meta: dict) -> LoRAConfig:
        """From a checkpoint's `lora_config` (after back-fill)."""
        alpha = meta.get("alpha")
        rank = int(meta["rank"])
        return cls(
            adapter_type=meta["adapter_type"],
            rank=rank,
            alpha=None if alpha is None or (isinstance(alpha, int) and alpha == rank) else alpha,
            include=tuple(meta["include"]) if meta.get("include") else None,
            exclude=tuple(meta["exclude"]) if meta.get("exclude") is not None else None,
        )
