"""The device-precision policy's compile notice."""

import tempfile

import mlx.core as mx

from sa3mlx.runtime.precision import compile_notice


def test_the_compile_notice_comes_before_every_compile_the_cache_has_not_seen(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    small, large = mx.zeros((2, 3)), mx.zeros((2, 5))
    for arrays, cold in (((small,), True), ((small,), False), ((large,), True), ((small, large), True)):
        with compile_notice("the test function", *arrays):
            pass
        said = capsys.readouterr().err
        assert said.startswith("sa3mlx: compiling the test function for the CPU") == cold, (arrays, said)
    with compile_notice("another function", small):
        pass
    assert "compiling another function" in capsys.readouterr().err
    assert len(list((tmp_path / "mlx" / mx.__version__ / "cpu" / "sa3mlx-compiled").iterdir())) == 4
