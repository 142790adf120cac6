"""Every stage's code dependencies in dvc.yaml: they cover every module the stage really imports, and
hold nothing but source, so neither a code change nor a tool's dropping can escape or fake a rerun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dvc_project import PROJECT_FILES, make_project, run

from sa3mlx.runtime.layout import DVC_FILE
from sa3mlx.runtime.params import dvc_stages, fill_vars

ROOT = Path(__file__).resolve().parents[1]
STAGES = dvc_stages(ROOT / DVC_FILE)
CODE_ROOTS = ("stages/", "sa3mlx/")

# Imports the stage script as a module (its main() is guarded) plus every module its main() can
# reach lazily, then lists the sa3mlx files loaded.
IMPORTED = """import importlib, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("stage_under_test", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
for name in sys.argv[2:]:
    importlib.import_module(name)
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("sa3mlx") and m.__file__)))
"""

# Modules a stage imports inside a function (only on some paths), named so the test loads them too.
LAZY = {
    "train": ["sa3mlx.train.job", "sa3mlx.train.demos", "sa3mlx.sample.render", "sa3mlx.sample.demo_models"],
    "demo": ["sa3mlx.sample.render", "sa3mlx.sample.demo_models"],
}


PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def fill(path: str) -> str:
    """A dvc.yaml path with its `${section.key}` filled from params.yaml."""
    flat = {f"{s}.{k}": v for s, values in PARAMS.items() if isinstance(values, dict) for k, v in values.items()}
    return fill_vars(path, flat)


def code_deps(stage: str) -> list[str]:
    return [d for d in STAGES[stage]["deps"] if d.startswith(CODE_ROOTS)]


def covered(path: str, deps: list[str]) -> bool:
    return any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps)


def imported_files(stage: str) -> list[str]:
    script = ROOT / f"stages/{stage}.py"
    result = subprocess.run(
        [sys.executable, "-c", IMPORTED, str(script), *LAZY.get(stage, [])],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return [Path(f).resolve().relative_to(ROOT).as_posix() for f in json.loads(result.stdout)]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_code_deps_cover_every_imported_module(stage):
    deps = code_deps(stage)
    assert f"stages/{stage}.py" in deps
    missing = [f for f in imported_files(stage) if not covered(f, deps)]
    assert missing == [], f"{stage} imports modules its dvc.yaml deps do not list: {missing}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_code_deps_are_source_only(stage):
    for dep in code_deps(stage):
        path = ROOT / dep
        assert path.exists(), f"{stage}: dependency {dep} does not exist"
        files = (
            [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        )
        assert files, f"{stage}: {dep} holds no file"
        # .cpp: the native kernels' source (sa3mlx/runtime/native.py builds it), which decides numbers too
        assert [p for p in files if p.suffix not in (".py", ".cpp")] == [], f"{stage}: {dep} holds non-source files"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_listed_code_file_is_imported(stage):
    files = imported_files(stage)
    unused = [d for d in code_deps(stage) if d.endswith(".py") and d not in files and d != f"stages/{stage}.py"]
    assert unused == [], f"{stage} lists code it never imports: {unused}"


def test_a_fresh_clone_agrees_with_the_committed_lock(tmp_path):
    """Code, params and inputs in git match dvc.lock: a clean machine only has to fetch or recompute outputs."""
    project = make_project(tmp_path / "clone", (*PROJECT_FILES, "dvc.lock", "dvclive"))
    status = json.loads(run(["dvc", "status", "--json"], project))
    produced = {out for stage in STAGES.values() for out in stage.get("outs", []) if isinstance(out, str)}
    produced |= {next(iter(out)) for stage in STAGES.values() for out in stage.get("outs", []) if isinstance(out, dict)}
    for stage, entries in status.items():
        for entry in entries:
            assert set(entry) <= {"changed deps", "changed outs"}, (stage, entry)  # never "changed params"/"cmd"
            for path, state in entry.get("changed deps", {}).items():
                assert state == "deleted" and fill(path) in {fill(p) for p in produced}, (stage, path, state)
            for path, state in entry.get("changed outs", {}).items():
                assert state == "not in cache", (stage, path, state)
