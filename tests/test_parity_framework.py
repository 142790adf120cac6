import math

import numpy as np
import pytest

from sa3mlx.cli import main
from sa3mlx.parity import registry
from sa3mlx.parity.compare import compare, psnr_db
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.run import check, recompute


def test_psnr_definition():
    ref = np.array([1.0, -2.0, 0.5, 0.0])
    got = ref + np.array([1e-3, -1e-3, 1e-3, -1e-3])
    assert psnr_db(ref, got) == pytest.approx(20 * math.log10(2.0 / 1e-3))
    assert psnr_db(ref, ref) == math.inf


def test_exact_comparisons_for_bool_int_and_json():
    mask = np.array([True, False])
    assert compare("m", mask, mask).passes(200)
    assert not compare("m", mask, ~mask).passes(0)
    assert not compare("ids", np.array([1, 2]), np.array([1, 3])).passes(0)
    assert compare("cfg", {"a": [1, 2]}, {"a": [1, 2]}).passes(1e9)
    assert not compare("cfg", {"a": [1, 2]}, {"a": [1, 3]}).passes(0)
    assert not compare("x", np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)).passes(0)
    assert not compare("x", np.ones(3, np.float32), np.array([1, np.nan, 1], np.float32)).passes(0)


def test_unknown_and_unimplemented_kinds_are_clear(monkeypatch):
    with pytest.raises(registry.ParityError, match="unknown parity kind 'nope'"):
        registry.runner_for("nope")
    monkeypatch.setitem(registry.THRESHOLDS_DB, "future_kind", 60.0)
    with pytest.raises(registry.ParityError, match="no implementation yet"):
        registry.runner_for("future_kind")


def test_every_kind_has_a_runner():
    for kind in registry.THRESHOLDS_DB:
        assert callable(registry.runner_for(kind))


@pytest.fixture
def fake_t5gemma_kind(monkeypatch):
    """A stand-in runner for the t5gemma kind that perturbs the reference by a param-scaled noise."""
    calls = []

    def runner(fixture: Fixture):
        params = fixture.params("expected.npz", "last_hidden_state")
        calls.append(params["model_dtype"])
        ref = fixture.reference("expected.npz")["last_hidden_state"]
        noise = np.random.default_rng(0).standard_normal(ref.shape).astype(np.float32)
        return {"expected.npz": {"last_hidden_state": ref + noise * 1e-4}}

    monkeypatch.setitem(registry.RUNNERS, "t5gemma", runner)
    return calls


def test_recompute_writes_computed_and_passthrough_keys(tmp_path, fixture_copy, fake_t5gemma_kind):
    folder = fixture_copy("t5gemma")
    recompute("t5gemma", folder, tmp_path / "out")
    with np.load(tmp_path / "out" / "expected.npz") as f:
        written = {k: f[k] for k in f.files}
    assert set(written) == {"last_hidden_state", "valid_mask"}
    inputs = Fixture(folder).load("inputs.npz:attention_mask")
    np.testing.assert_array_equal(written["valid_mask"], inputs.astype(bool))
    assert fake_t5gemma_kind == ["float32"]  # call parameters come from params.json


def test_check_reports_psnr_and_missing_keys(fixture_copy, fake_t5gemma_kind):
    report = check("t5gemma", fixture_copy("t5gemma"))
    rows = {c.key: c for _, c in report.rows}
    ref = Fixture(report.fixture).reference("expected.npz")["last_hidden_state"]
    expected_db = 20 * math.log10(np.abs(ref).max() / 1e-4)
    assert rows["last_hidden_state"].psnr_db == pytest.approx(expected_db, abs=0.1)
    assert rows["valid_mask"].psnr_db == math.inf
    assert "expected.npz:hidden_states_0" in report.missing
    assert report.ok and report.computed == 1


def test_cli_check_fails_below_threshold(monkeypatch, fixture_copy, capsys, fake_t5gemma_kind):
    folder = fixture_copy("t5gemma")
    assert main(["parity", "check", "t5gemma", str(folder)]) == 0
    monkeypatch.setitem(registry.THRESHOLDS_DB, "t5gemma", 200.0)
    assert main(["parity", "check", "t5gemma", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "PSNR" in out


def test_a_kind_that_computes_nothing_does_not_pass(monkeypatch, fixture_copy):
    monkeypatch.setitem(registry.RUNNERS, "t5gemma", lambda fixture: {})
    report = check("t5gemma", fixture_copy("t5gemma"))
    assert not report.ok and report.computed == 0
