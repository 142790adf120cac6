"""A fixture folder and its params.json: groups, call parameters, inputs, pass-through keys."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np

from sa3mlx.convert.checkpoint import read_safetensors


class Fixture:
    def __init__(self, folder: str | Path):
        self.dir = Path(folder)
        if not (self.dir / "params.json").is_file():
            raise FileNotFoundError(f"{self.dir}: not a fixture folder (no params.json)")

    @cached_property
    def spec(self) -> dict:
        return json.loads((self.dir / "params.json").read_text())

    @property
    def name(self) -> str:
        return self.spec.get("folder", self.dir.name)

    def expected_files(self) -> list[str]:
        return list(self.spec["expected"])

    def groups(self, file: str) -> dict[str, dict]:
        return self.spec["expected"][file].get("groups", {})

    def params(self, file: str, group: str | None = None) -> dict:
        """Plain values of the file-level params overridden by the group's."""
        entry = self.spec["expected"][file]
        merged = dict(entry.get("params", {}))
        if group is not None:
            merged.update(self.groups(file)[group].get("params", {}))
        return {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in merged.items()}

    def inputs(self, file: str, group: str | None = None) -> dict[str, str]:
        entry = self.spec["expected"][file]
        merged = dict(entry.get("inputs", {}))
        if group is not None:
            merged.update(self.groups(file)[group].get("inputs", {}))
        return merged

    def path(self, relative: str) -> Path:
        return (self.dir / relative).resolve()

    def load(self, ref: str):
        """`file.npz:key`, `file.safetensors:key`, or a whole `file.npz` / `file.safetensors`."""
        file, _, key = ref.partition(":")
        data = read_fixture_file(self.path(file))
        return data[key] if key else data

    def reference(self, file: str):
        """The stored expected file (dict of arrays, or parsed JSON)."""
        return read_fixture_file(self.dir / file)

    def passthrough(self) -> dict[str, dict[str, dict]]:
        return self.spec.get("passthrough_keys", {})


def read_fixture_file(path: Path):
    """A fixture file as a dict of arrays (.npz, .safetensors) or parsed JSON."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    if path.suffix == ".safetensors":
        return read_safetensors(path)[0]
    if path.suffix == ".json":
        return json.loads(path.read_text())
    raise ValueError(f"{path}: unsupported fixture file type")
