"""Demo entries (params `demo.entries`, `train.demos.entries`): what to render, with underfit's
defaults, the latent length of a demo, its file names and its underfit sidecar record.

Base entries (`arc: false`) render on the base model with Euler (defaults 50 steps, cfg 7 with
APG); ARC entries on the post-trained ARC model with ping-pong (8 steps, cfg 1). Every entry
renders with the adapter(s) and, when baselines are asked for, once more at strength 0 with the
same seed, so the difference is the adapter alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from sa3mlx.runtime.errors import ParamError

BASE_DEFAULTS = {"steps": 50, "cfg": 7.0}  # underfit's RF demos
ARC_DEFAULTS = {"steps": 8, "cfg": 1.0}  # underfit's ARC demos
TAIL_SECONDS = 5.0  # rendered and kept past seconds_total, as underfit's trim
DEMO_NAME = re.compile(r"^demo_(\d+)_(\d{8})$")
BASELINE_NAME = re.compile(r"^baseline_(\d+)$")


_TYPES = {
    "prompt": str,
    "seconds": float,
    "seed": int,
    "steps": int,
    "cfg": float,
    "apg": bool,
    "lora_strength": float,
    "lora_interval_max": float,
    "arc": bool,
    "negative_prompt": str,
}


@dataclass(frozen=True)
class AdapterRef:
    """One adapter file and the strength it renders at (torch strength semantics)."""

    path: Path
    strength: float = 1.0

    @classmethod
    def parse(cls, item) -> AdapterRef:
        """`{path, strength}`, `"FILE:strength"` or a plain path."""
        if isinstance(item, AdapterRef):
            return item
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"path", "strength"})
            if unknown or "path" not in item:
                raise ValueError(f"adapter {item}: expected keys path and strength")
            return cls(Path(item["path"]), float(item.get("strength", 1.0)))
        head, sep, tail = str(item).rpartition(":")
        if sep:
            try:
                return cls(Path(head), float(tail))
            except ValueError:
                pass
        return cls(Path(str(item)))


@dataclass(frozen=True)
class DemoEntry:
    prompt: str
    seconds: float = 10.0
    seed: int = 0
    steps: int | None = None  # None: 50 base, 8 ARC
    cfg: float | None = None  # None: 7 base, 1 ARC
    apg: bool = True  # guidance keeps only the part of the cfg update orthogonal to the conditional
    lora_strength: float = 1.0
    lora_interval_max: float | None = None  # base only: adapter off while sigma > this, on after
    arc: bool = False
    negative_prompt: str | None = None
    adapters: tuple[AdapterRef, ...] | None = None  # None: the adapter(s) the renderer is given

    @classmethod
    def from_dict(cls, d: dict, defaults: dict | None = None) -> DemoEntry:
        """One params entry; `defaults` ({"base": {...}, "arc": {...}}) fill steps/cfg left null."""
        if not isinstance(d, dict) or "prompt" not in d:
            raise ValueError(f"demo entry {d!r}: needs at least a 'prompt' (empty for unconditional)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"demo entry '{d['prompt']}': unknown field(s) {unknown}; known: {sorted(known)}")
        values = {k: v for k, v in d.items() if v is not None}
        arc = bool(values.get("arc", False))
        family = dict(ARC_DEFAULTS if arc else BASE_DEFAULTS)
        family.update((defaults or {}).get("arc" if arc else "base", {}) or {})
        values.setdefault("steps", family["steps"])
        values.setdefault("cfg", family["cfg"])
        for name, kind in _TYPES.items():
            if name in values:
                values[name] = kind(values[name])
        if "adapters" in values:
            values["adapters"] = tuple(AdapterRef.parse(a) for a in values["adapters"])
        return cls(**values).checked()

    def resolved(self) -> DemoEntry:
        """steps/cfg left None filled with underfit's defaults for the entry's family."""
        family = ARC_DEFAULTS if self.arc else BASE_DEFAULTS
        return replace(
            self, steps=self.steps or family["steps"], cfg=family["cfg"] if self.cfg is None else self.cfg
        ).checked()

    def checked(self) -> DemoEntry:
        if self.seconds <= 0:
            raise ValueError(f"demo entry '{self.prompt}': seconds must be > 0, got {self.seconds}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"demo entry '{self.prompt}': steps must be >= 1, got {self.steps}")
        if self.lora_interval_max is not None and not 0 <= self.lora_interval_max <= 1:
            raise ValueError(f"demo entry '{self.prompt}': lora_interval_max must be in [0, 1]")
        return self

    @property
    def sampler(self) -> str:
        return "pingpong" if self.arc else "euler"

    def adapter_set(self, default: tuple[AdapterRef, ...]) -> tuple[AdapterRef, ...]:
        """The adapters this entry renders with: its own list, else `default` at lora_strength."""
        if self.adapters is not None:
            return self.adapters
        return tuple(AdapterRef(a.path, a.strength * self.lora_strength) for a in default)

    def sidecar(self, baseline: bool = False) -> dict:
        """underfit's demo JSON: base {prompt, cfg, seed, lora_strength, lora_skip}; ARC {prompt,
        cfg, arc, steps, seed, lora_interval_max}; a baseline is the same entry at strength 0."""
        if self.arc:
            record = {"prompt": self.prompt, "cfg": self.cfg, "arc": True, "steps": self.steps, "seed": self.seed}
            if self.lora_interval_max is not None:
                record["lora_interval_max"] = self.lora_interval_max
            if baseline or self.lora_strength != 1.0:
                record["arc_lora_strength"] = 0.0 if baseline else self.lora_strength
        else:
            record = {
                "prompt": self.prompt,
                "cfg": self.cfg,
                "seed": self.seed,
                "lora_strength": 0.0 if baseline else self.lora_strength,
            }
            if self.lora_interval_max is not None and not baseline:
                record["lora_skip"] = self.lora_interval_max
            record["steps"] = self.steps
        record["seconds_total"] = self.seconds
        if self.negative_prompt:
            record["negative_prompt"] = self.negative_prompt
        if self.adapters is not None and not baseline:
            record["adapters"] = [{"path": str(a.path), "strength": a.strength} for a in self.adapters]
        return record


def parse_entries(items, defaults: dict | None = None) -> list[DemoEntry]:
    return [
        item.resolved() if isinstance(item, DemoEntry) else DemoEntry.from_dict(item, defaults) for item in items or ()
    ]


def checked_entries(key: str, items, defaults=None) -> list[DemoEntry]:
    """`parse_entries` of a params list: a bad entry is a ParamError naming `key[i]`."""
    if not isinstance(items, (list, tuple)):
        raise ParamError(key, "expected a list of entries", items)
    if defaults is not None and not isinstance(defaults, dict):
        raise ParamError(key.rsplit(".", 1)[0] + ".defaults", "expected a mapping {base: ..., arc: ...}", defaults)
    entries = []
    for index, item in enumerate(items):
        try:
            entries.append(DemoEntry.from_dict(item, defaults))
        except (ValueError, TypeError, AttributeError) as e:
            raise ParamError(f"{key}[{index}]", str(e), show_value=False) from None
    return entries


def latent_count(
    seconds: float, sample_rate: int, samples_per_latent: int, modulo: int = 1, tail: float = TAIL_SECONDS
) -> int:
    """Latents rendered for a demo: ceil((seconds + tail) · rate / 4096), up to the codec's modulo."""
    count = math.ceil(round((seconds + tail) * sample_rate) / samples_per_latent)
    return -(-count // modulo) * modulo


def kept_samples(seconds: float, sample_rate: int, tail: float = TAIL_SECONDS) -> int:
    """Samples written per channel: (seconds_total + tail) · rate."""
    return int(round((seconds + tail) * sample_rate))


def demo_stem(index: int, step: int | None) -> str:
    """`demo_<i>_<step:08d>` (underfit's name), or `baseline_<i>` for step None."""
    return f"baseline_{index}" if step is None else f"demo_{index}_{step:08d}"


def parse_stem(stem: str) -> tuple[int, int | None] | None:
    """(index, step) of a demo stem, step None for a baseline; None for anything else."""
    if match := DEMO_NAME.match(stem):
        return int(match.group(1)), int(match.group(2))
    if match := BASELINE_NAME.match(stem):
        return int(match.group(1)), None
    return None


@dataclass
class RenderSummary:
    rendered: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)  # entry index -> why
    seconds_of_audio: float = 0.0
    wall_seconds: float = 0.0

    def line(self) -> str:
        return (
            f"demos: {len(self.rendered)} rendered, {len(self.existing)} already there, "
            f"{len(self.skipped)} skipped; {self.seconds_of_audio:.1f} s of audio in {self.wall_seconds:.1f} s"
        )
