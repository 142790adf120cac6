import shutil
from pathlib import Path

import pytest

import sa3mlx  # noqa: F401  (BLAS set-up before any test imports mlx)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture
def fixture_copy(tmp_path):
    """A writable copy of one fixture folder (siblings included, so `../t5gemma` resolves)."""

    def copy(*names: str) -> Path:
        for name in names:
            shutil.copytree(FIXTURES / name, tmp_path / "fixtures" / name)
        return tmp_path / "fixtures" / names[0]

    return copy
