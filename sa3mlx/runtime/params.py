"""Reading a stage's section of params.yaml."""

from __future__ import annotations

from pathlib import Path

import yaml

PARAMS_FILE = "params.yaml"


def load_params(section: str, path: str | Path = PARAMS_FILE) -> dict:
    """The mapping under `section` in params.yaml; a clear error if it is absent."""
    path = Path(path)
    with open(path) as f:
        params = yaml.safe_load(f) or {}
    if section not in params:
        raise KeyError(f"{path}: no '{section}' section")
    return params[section]
