"""The library's layering (ARCHITECTURE.md): a package imports only packages of lower layers.

Deviations from the original card, on purpose: `lora` and `sample` read key names from `convert`
(the one home of the torch <-> MLX names), and `parity`/`cli` sit on top of everything.
"""

import ast

import pytest
from conftest import ROOT

ALLOWED = {
    "runtime": set(),
    "audio": {"runtime"},
    "models": {"runtime"},
    "convert": {"models", "runtime"},
    "lora": {"convert", "models", "runtime"},
    "sample": {"convert", "lora", "models", "audio", "runtime"},
    "data": {"models", "audio", "runtime"},
    "train": {"models", "lora", "data", "sample", "runtime"},
}


def imported_packages(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n.split(".")[1] for n in names if n.startswith("sa3mlx.")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package):
    offenders = []
    for path in sorted((ROOT / "sa3mlx" / package).glob("*.py")):
        for imported in imported_packages(path) - ALLOWED[package] - {package}:
            offenders.append(f"{path.relative_to(ROOT)} imports sa3mlx.{imported}")
    assert not offenders, "\n".join(offenders)
