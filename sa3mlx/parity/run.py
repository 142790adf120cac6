"""`sa3mlx parity`: recompute a fixture folder's expected files, and check them."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sa3mlx.parity.compare import Comparison, compare
from sa3mlx.parity.fixture import Fixture, read_fixture_file
from sa3mlx.parity.registry import FOLDERS, THRESHOLDS_DB, ParityError, runner_for
from sa3mlx.runtime.io import save_json, save_npz


def recompute(kind: str, fixture_dir: str | Path, out_dir: str | Path) -> dict[str, dict]:
    """Run the kind's runner on the fixture, add pass-through keys, write the files to out_dir."""
    fixture = Fixture(fixture_dir)
    outputs = runner_for(kind)(fixture)
    for file, keys in fixture.passthrough().items():
        if file in outputs or file in fixture.expected_files():
            target = outputs.setdefault(file, {})
            for key, info in keys.items():
                target.setdefault(key, _passthrough_value(fixture, file, key, info.get("source", "input")))
    out_dir = Path(out_dir)
    for file, values in outputs.items():
        _write(out_dir / file, values)
    return outputs


def _passthrough_value(fixture: Fixture, file: str, key: str, source: str):
    """Copies are taken from their source file when it names one, else from the stored expected file."""
    reference = fixture.reference(file) if (fixture.dir / file).is_file() else {}
    if ":" in source and (fixture.dir / source.split(":")[0]).is_file():
        value = fixture.load(source)
        if isinstance(reference, dict) and key in reference and isinstance(value, np.ndarray):
            value = value.astype(reference[key].dtype)
        return value
    if key not in reference:
        raise ParityError(f"{fixture.dir / file}: pass-through key '{key}' has no readable source ({source})")
    return reference[key]


def _write(path: Path, values: dict) -> None:
    if path.suffix == ".npz":
        save_npz(path, {k: np.asarray(v) for k, v in values.items()})
    elif path.suffix == ".json":
        save_json(path, values)
    else:
        raise ParityError(f"{path}: cannot write expected files of this type")


@dataclass
class Report:
    kind: str
    fixture: Path
    threshold_db: float
    rows: list[tuple[str, Comparison]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # reference keys the kind does not compute (yet)
    passthrough: set[str] = field(default_factory=set)  # copies of inputs, compared but not counted

    @property
    def failures(self) -> list[str]:
        return [f"{file}:{c.key}" for file, c in self.rows if not c.passes(self.threshold_db)]

    @property
    def computed(self) -> int:
        return sum(f"{file}:{c.key}" not in self.passthrough for file, c in self.rows)

    @property
    def ok(self) -> bool:
        """Every compared key passes and at least one was really computed."""
        return self.computed > 0 and not self.failures

    def lines(self) -> list[str]:
        out = [f"parity {self.kind}: {self.fixture} (pass: PSNR >= {self.threshold_db:g} dB)"]
        for file, c in self.rows:
            verdict = "ok" if c.passes(self.threshold_db) else "FAIL"
            if f"{file}:{c.key}" in self.passthrough:
                verdict += " (pass-through)"
            out.append(f"  {file}:{c.key:<32} max|d| {c.max_abs:10.3e}  PSNR {_db(c.psnr_db):>9}  {verdict}")
        for name in self.missing:
            out.append(f"  {name:<45} not computed by this kind")
        out.append(
            f"  {self.computed} computed, {len(self.failures)} failed, "
            f"{len(self.missing)} not computed, {len(self.passthrough)} pass-through"
        )
        return out


def _db(value: float) -> str:
    return "inf" if value == math.inf else "-inf" if value == -math.inf else f"{value:.1f} dB"


def check(kind: str, fixture_dir: str | Path) -> Report:
    """Recompute into a temp dir and compare every produced key with the stored reference."""
    fixture = Fixture(fixture_dir)
    report = Report(kind, fixture.dir, THRESHOLDS_DB[kind])
    report.passthrough = {f"{file}:{key}" for file, keys in fixture.passthrough().items() for key in keys}
    with tempfile.TemporaryDirectory() as tmp:
        recompute(kind, fixture.dir, tmp)
        for file in fixture.expected_files():
            produced = Path(tmp) / file
            reference = fixture.reference(file)
            result = read_fixture_file(produced) if produced.is_file() else {}
            for key in reference:
                if key in result:
                    report.rows.append((file, compare(key, reference[key], result[key])))
                else:
                    report.missing.append(f"{file}:{key}")
    return report


def default_fixture_dirs(kind: str, root: str | Path = "tests/fixtures") -> list[Path]:
    if kind not in FOLDERS:
        raise ParityError(f"unknown parity kind '{kind}' (known: {', '.join(FOLDERS)})")
    return [Path(root) / name for name in FOLDERS[kind]]
