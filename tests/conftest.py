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


def evaluated_with_peak(compute):
    """(compute()'s evaluated result, MLX's peak memory above what was held before): arrays that earlier
    tests keep alive count in MLX's peak, so the peak alone depends on the tests run before."""
    import mlx.core as mx  # after sa3mlx's BLAS set-up above

    mx.clear_cache()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    result = compute()
    mx.eval(result)
    return result, mx.get_peak_memory() - held
