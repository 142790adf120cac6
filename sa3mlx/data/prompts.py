"""Training prompts from a clip's metadata: underfit's prompt templates, as the dashboard intends them.

underfit's torch loop never hands the dashboard's `prompt_config` to its template module and
so always trains on the legacy tag prompt; here the config is honoured. With a config, one
source is picked per draw by weight among the enabled ones: `tags` ("Label: value" parts,
half the time all of them shuffled, half the time a random-size subset), `paths` (the latent's
relpath, optionally without extension or folders) or `fixed` text; a trigger word is then
prepended with `trigger_probability`. Without a config: the legacy tag prompt. Every draw uses
the `random.Random` it is given (its `getstate()` is the serialisable state), in the same call
order as underfit, so a Random in the same state gives underfit's prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

# metadata key -> the label a tag prompt shows; this order is the default tag order
TAG_LABELS = {
    "title": "Title",
    "artist": "Artist",
    "album": "Album",
    "genre": "Genre",
    "label": "Label",
    "date": "Year",
    "composer": "Composer",
    "bpm": "BPM",
    "prompt": "Prompt",
}
SOURCES = ("tags", "paths", "fixed")


@dataclass(frozen=True)
class PromptTemplate:
    """A dashboard `prompt_config` (defaults: underfit's template module, not its UI)."""

    use_tags: bool = True
    use_paths: bool = False
    use_fixed: bool = False
    fixed_text: str = ""
    weight_tags: float = 50
    weight_paths: float = 50
    weight_fixed: float = 0
    tag_keys: tuple[str, ...] = tuple(TAG_LABELS)
    hide_tag_names: bool = False
    hide_commas: bool = False
    split_commas: bool = False
    shuffle: bool = True
    path_hide_ext: bool = False
    path_hide_dirs: bool = False
    path_hide_topmost_dir: bool = False
    trigger: str = ""
    trigger_probability: float = 0.8

    def __post_init__(self):
        object.__setattr__(self, "tag_keys", tuple(self.tag_keys))
        if not 0.0 <= self.trigger_probability <= 1.0:
            raise ValueError(f"trigger_probability must be in [0, 1], got {self.trigger_probability}")

    @classmethod
    def from_dict(cls, d: dict) -> PromptTemplate:
        """Our field names, or the dashboard's `prompt_config` (`balance`, `path_opts` in camelCase
        or snake_case, `trigger_pct` in percent). Unknown keys are an error."""
        d = dict(d)
        balance = d.pop("balance", {}) or {}
        for source in SOURCES:
            if source in balance:
                d.setdefault(f"weight_{source}", balance[source])
        paths = d.pop("path_opts", {}) or {}
        for ours, camel, snake in (
            ("path_hide_ext", "hideExt", "hide_ext"),
            ("path_hide_dirs", "hideDirs", "hide_dirs"),
            ("path_hide_topmost_dir", "hideTopmostDir", "hide_topmost_dir"),
        ):
            if camel in paths or snake in paths:
                d.setdefault(ours, paths.get(camel, paths.get(snake)))
        if "trigger_pct" in d:
            d.setdefault("trigger_probability", float(d.pop("trigger_pct")) / 100.0)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown prompt template key(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def weights(self) -> list[tuple[str, float]]:
        enabled = (
            ("tags", self.use_tags, self.weight_tags),
            ("paths", self.use_paths, self.weight_paths),
            ("fixed", self.use_fixed, self.weight_fixed),
        )
        return [(name, weight) for name, on, weight in enabled if on]


def _value(metadata: dict, key: str) -> str:
    value = metadata.get(key, "")
    if isinstance(value, (list, tuple)):
        value = value[0] if value else ""
    return str(value).strip()


def _pick_parts(parts: list[str], rng: random.Random) -> list[str]:
    """Half the time all parts shuffled, half the time a random-size subset in random order."""
    if rng.random() < 0.5:
        rng.shuffle(parts)
        return parts
    return rng.sample(parts, rng.randint(1, len(parts)))


def tag_prompt(metadata: dict, template: PromptTemplate, rng: random.Random) -> str:
    parts = []
    for key in template.tag_keys:
        value = _value(metadata, key)
        if not value:
            continue
        label = TAG_LABELS.get(key, key)
        pieces = [p.strip() for p in value.split(",")] if template.split_commas and "," in value else [value]
        parts += [p if template.hide_tag_names else f"{label}: {p}" for p in pieces if p]
    if not parts:
        return ""
    if template.shuffle:
        parts = _pick_parts(parts, rng)
    return (" " if template.hide_commas else ", ").join(parts)


def path_prompt(metadata: dict, template: PromptTemplate) -> str:
    relpath = _value(metadata, "relpath")
    if not relpath:
        return ""
    *dirs, name = relpath.replace("\\", "/").split("/")
    if template.path_hide_ext and name.rfind(".") > 0:
        name = name[: name.rfind(".")]
    if template.path_hide_dirs:
        return name if template.path_hide_topmost_dir or not dirs else f"{dirs[0]}/{name}"
    if template.path_hide_topmost_dir:
        dirs = dirs[1:]
    return "/".join([*dirs, name])


def legacy_prompt(metadata: dict, rng: random.Random) -> str:
    """No config: every present tag as "Label: value", shuffled or a random subset; else `text`."""
    parts = [f"{label}: {_value(metadata, key)}" for key, label in TAG_LABELS.items() if _value(metadata, key)]
    if not parts:
        return metadata.get("text", "")
    return ", ".join(_pick_parts(parts, rng))


def build_prompt(metadata: dict, template: PromptTemplate | None, rng: random.Random) -> str:
    """One training prompt for a clip's metadata (its encode sidecar: tags, relpath, ...)."""
    if template is None:
        return legacy_prompt(metadata, rng)
    # every enabled source is built before the pick, as underfit does (same random draws)
    built = {
        "tags": lambda: tag_prompt(metadata, template, rng),
        "paths": lambda: path_prompt(metadata, template),
        "fixed": lambda: template.fixed_text,
    }
    candidates = [(name, built[name](), weight) for name, weight in template.weights()]
    if not candidates:
        method, prompt = None, metadata.get("text", "")
    else:
        weights = [w for _, _, w in candidates]
        method, prompt, _ = (
            rng.choice(candidates) if sum(weights) <= 0 else rng.choices(candidates, weights=weights, k=1)[0]
        )
    if template.trigger and template.trigger_probability > 0 and rng.random() < template.trigger_probability:
        if not prompt:
            return template.trigger
        comma = method == "tags" and not template.hide_commas
        prompt = template.trigger + (", " if comma else " ") + prompt
    return prompt


def has_prompt_source(metadata: dict, template: PromptTemplate | None) -> bool:
    """Can any draw give this clip a non-empty prompt (a tag, its path, fixed text, a trigger)?"""
    text = bool(str(metadata.get("text", "")).strip())
    if template is None:
        return text or any(_value(metadata, key) for key in TAG_LABELS)
    if template.trigger and template.trigger_probability > 0:
        return True
    sources = {
        "tags": lambda: any(_value(metadata, key) for key in template.tag_keys),
        "paths": lambda: bool(_value(metadata, "relpath")),
        "fixed": lambda: bool(template.fixed_text.strip()),
    }
    enabled = [name for name, _ in template.weights()]
    return any(sources[name]() for name in enabled) if enabled else text


def preview(metadatas: list[dict], template: PromptTemplate | None, n: int = 10, seed: int = 0) -> list[str]:
    """n sample prompts cycling through the clips, from their own Random (training draws untouched)."""
    if not metadatas:
        return []
    rng = random.Random(seed)
    return [build_prompt(metadatas[i % len(metadatas)], template, rng) for i in range(n)]


def rng_state(rng: random.Random) -> list:
    """A JSON-serialisable form of `rng.getstate()`."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_state(state: list) -> random.Random:
    rng = random.Random()
    rng.setstate((state[0], tuple(state[1]), state[2]))
    return rng
