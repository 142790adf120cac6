"""A stage's params: only the keys its `dvc.yaml` entry declares, and a record of which it read.

    params = stage_params("train")          # in stages/train.py
    params["train"]["lr"]                   # declared: its value
    params["train"]["batch"]                # not declared: UndeclaredParamError names stage and key

DVC reruns a stage only when a param it declares changes, so a stage that read anything else
could leave stale outputs. Here the stage cannot: sections and the params tree down to each
declared key are read-only views that refuse every other key (even through `.get`), and listing a
section (`dict(section)`, `.items()`) refuses one that params.yaml fills with undeclared keys; the
value of a declared key is the stage's own deep copy (a whole subtree like `train.adapter` included).

With `SA3MLX_PARAMS_AUDIT=<dir>` set, each stage writes `<dir>/<stage>.json` at exit:
`{"stage", "declared", "read"}`, for the test that every declared key is read.
"""

from __future__ import annotations

import atexit
import copy
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import yaml

from sa3mlx.runtime.errors import MissingParamError, ParamError, UserError
from sa3mlx.runtime.io import save_json
from sa3mlx.runtime.schema import SHARED_SPECS, options_from_params

PARAMS_FILE = "params.yaml"
DVC_FILE = "dvc.yaml"
AUDIT_ENV = "SA3MLX_PARAMS_AUDIT"


class UndeclaredParamError(LookupError):
    """Not a KeyError on purpose: `.get(key, default)` must not hide an undeclared read."""


class UnknownParamError(UndeclaredParamError, UserError):
    """params.yaml sets a key under a section that the stage does not declare (the user's to fix)."""


class ParamsUsage:
    """Which declared keys a stage has; which dotted keys it has read so far."""

    def __init__(self, stage: str, declared: list[str]):
        self.stage, self.declared, self.read = stage, declared, set()

    def covering(self, key: str) -> str | None:
        """The declared key `key` lies at or under, if any."""
        return next((d for d in self.declared if key == d or key.startswith(d + ".")), None)

    def is_section(self, key: str) -> bool:
        """Is `key` above some declared key (a section to descend into)?"""
        return any(d.startswith(key + ".") for d in self.declared)

    def unread(self) -> list[str]:
        return [d for d in self.declared if not any(r == d or r.startswith(d + ".") for r in self.read)]

    def record(self) -> dict:
        return {"stage": self.stage, "declared": sorted(self.declared), "read": sorted(self.read)}


class StageParams(Mapping):
    """A read-only view of one level of params.yaml, cut down to a stage's declared keys."""

    def __init__(self, data: Mapping, usage: ParamsUsage, prefix: str = ""):
        self._data, self._usage, self._prefix = data, usage, prefix

    def _path(self, key: str) -> str:
        return f"{self._prefix}.{key}" if self._prefix else str(key)

    def _visible(self, key: str) -> bool:
        path = self._path(key)
        return self._usage.covering(path) is not None or self._usage.is_section(path)

    def __getitem__(self, key: str):
        path, usage = self._path(key), self._usage
        declared = usage.covering(path)
        if declared is None and not usage.is_section(path):
            raise UndeclaredParamError(
                f"stage '{usage.stage}' reads param '{path}' but {DVC_FILE} does not declare it: add "
                f"'{path}' to the stage's params: (or stop reading it), or DVC will not rerun the stage "
                "when it changes"
            )
        if key not in self._data:
            raise MissingParamError(path, f"missing (stage '{usage.stage}' reads it)", show_value=False)
        value = self._data[key]
        if declared is None:  # a section above declared keys: descend
            if not isinstance(value, Mapping):
                raise ParamError(path, "expected a mapping (keys under it are read)", value)
            return StageParams(value, usage, path)
        usage.read.add(path)
        if path in SHARED_SPECS:
            return SHARED_SPECS[path].check(path, value)
        return copy.deepcopy(value)

    def __contains__(self, key) -> bool:  # membership is not a read
        return key in self._data and self._visible(key)

    def __iter__(self) -> Iterator[str]:
        """The declared keys. Listing a section that params.yaml fills with more keys than the stage
        declares is an error: a stage that takes a whole section (`TrainConfig` overrides) would
        otherwise silently ignore a key the user set."""
        if self._prefix:
            extra = [self._path(key) for key in self._data if not self._visible(key)]
            if extra:
                raise UnknownParamError(
                    f"{PARAMS_FILE}: {extra[0]}: unknown key (stage '{self._usage.stage}' does not declare it "
                    f"under params: in {DVC_FILE}): remove it, or add it there too so a change reruns the stage"
                )
        return (key for key in self._data if self._visible(key))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def usage(self) -> ParamsUsage:
        return self._usage

    def to_dict(self) -> dict:
        """A plain deep copy of the visible keys (reads them all)."""
        return {key: value.to_dict() if isinstance(value, StageParams) else value for key, value in self.items()}

    def __repr__(self) -> str:
        visible = sorted(k for k in self._data if self._visible(k))
        return f"StageParams({self._usage.stage!r}, {self._prefix or '<root>'}: {visible})"


def declared_params(stage: str, dvc_file: str | Path = DVC_FILE) -> list[str]:
    """The dotted params.yaml keys that `stage` declares under `params:` in dvc.yaml."""
    stages = (yaml.safe_load(Path(dvc_file).read_text()) or {}).get("stages") or {}
    if stage not in stages:
        raise KeyError(f"{dvc_file}: no stage '{stage}' (stages: {', '.join(stages)})")
    keys = []
    for entry in stages[stage].get("params") or []:
        if isinstance(entry, str):
            keys.append(entry)
        elif isinstance(entry, Mapping) and set(entry) == {PARAMS_FILE} and entry[PARAMS_FILE]:
            keys.extend(entry[PARAMS_FILE])
        else:
            raise ValueError(
                f"{dvc_file}: stage '{stage}' params entry {entry!r}: only keys of {PARAMS_FILE} "
                "are supported (write them as 'section.key' or a whole 'section')"
            )
    return keys


_USAGE: dict[tuple, ParamsUsage] = {}  # one record per project and stage in a process


def stage_params(stage: str, root: str | Path = ".") -> StageParams:
    """params.yaml under `root`, cut down to what `stage` declares in `root`/dvc.yaml."""
    root = Path(root)
    declared = declared_params(stage, root / DVC_FILE)
    data = load_params_file(root / PARAMS_FILE)
    slot = (str(root.resolve()), stage, tuple(declared))
    usage = _USAGE.get(slot)
    if usage is None:
        usage = _USAGE[slot] = ParamsUsage(stage, declared)
        if os.environ.get(AUDIT_ENV):
            atexit.register(write_audit, usage, Path(os.environ[AUDIT_ENV]))
    return StageParams(data, usage)


def load_params_file(path: Path) -> dict:
    """params.yaml as a mapping; a missing file or a YAML mistake is a one-line UserError."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing (every stage reads its params from it)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}:{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise UserError(f"{path}: expected a mapping of sections (model:, train:, ...)")
    return data


def write_audit(usage: ParamsUsage, folder: Path) -> None:
    save_json(folder / f"{usage.stage}.json", usage.record())


def dataclass_from_params(cls, params: Mapping, section: str):
    """`cls(**params)` for an options dataclass, each value checked (sa3mlx.runtime.schema)."""
    return options_from_params(cls, params, section)
