import math

import pytest
from conftest import FIXTURES

from sa3mlx.parity import lora as lora_kind
from sa3mlx.parity.compare import psnr_db
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check

FOLDER = FIXTURES / "lora"
FLOOR_DB = THRESHOLDS_DB["lora"]


def _db(value: float) -> str:
    return "inf" if value == math.inf else f"{value:.1f}"


def test_parity_check_lora_passes_every_computed_key():
    report = check("lora", FOLDER)
    for line in report.lines():
        print(line)
    assert report.ok, report.failures
    computed = [(file, c) for file, c in report.rows if f"{file}:{c.key}" not in report.passthrough]
    assert all(c.psnr_db >= FLOOR_DB for _, c in computed)
    files = {file for file, _ in computed}
    assert {
        f"layer_{t}.npz"
        for t in (
            "lora",
            "dora-rows",
            "dora-cols",
            "bora",
            "lora-xs",
            "dora-rows-xs",
            "dora-cols-xs",
            "bora-xs",
            "dora",
        )
    } <= files
    assert {"layer_inputs.npz", "include_exclude_examples.json", "dit_lora_layers.json", "dit_expected.npz"} <= files
    assert not report.missing


def test_legacy_dora_checkpoint_behaves_as_dora_cols():
    rows = lora_kind.extra_checks(Fixture(FOLDER))
    assert len(rows) == 12
    for key, c in rows:
        print(f"{key:<60} PSNR {_db(c.psnr_db)} dB")
        assert c.passes(FLOOR_DB), key


@pytest.mark.parametrize(
    "file", [f for f in Fixture(FOLDER).expected_files() if f.startswith("layer_") and f != "layer_inputs.npz"]
)
def test_unmaterialized_form_matches_the_fixtures(file):
    fixture = Fixture(FOLDER)
    produced = lora_kind.layer_outputs(fixture, file, materialize=False)
    reference = fixture.reference(file)
    for key in (k for k in produced if k.startswith("y_")):
        db = psnr_db(reference[key], produced[key])
        print(f"{file}:{key} unmaterialized PSNR {_db(db)} dB")
        assert db >= FLOOR_DB, key


def test_adapted_dit_unmaterialized_matches_the_fixture():
    fixture = Fixture(FOLDER)
    produced = lora_kind.dit_outputs(fixture, materialize=False)
    reference = fixture.reference("dit_expected.npz")
    assert set(produced) == set(reference)
    for key, value in produced.items():
        db = psnr_db(reference[key], value)
        print(f"dit_expected.npz:{key} unmaterialized PSNR {_db(db)} dB")
        assert db >= FLOOR_DB, key
