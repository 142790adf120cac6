"""In-training demos (`train.demos`): rendered at step 0 and every k steps after that step's save,
into the run's demos/ folder, idempotent on resume, bit-exact adapters with demos on or off, out of
the resume fingerprint, and the train stage's DVC deps covering the rendering code."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from test_train_loop_fake import TINY_PARAMS, make_tiny_project

from sa3mlx.convert.model import convert_source
from sa3mlx.runtime.errors import ArtifactError
from sa3mlx.train.demos import DemoSettings, TrainDemos
from sa3mlx.train.job import DEMO_DEPS, TrainJob
from sa3mlx.train.resume import fingerprint, resume_files
from sa3mlx.train.runs import list_checkpoints

ENTRIES = [
    {"prompt": "house drums", "seconds": 0.5, "seed": 1, "steps": 2, "cfg": 1},
    {"prompt": "pad", "seconds": 0.5, "seed": 2, "steps": 2, "arc": True},
]
DEMOS = {"every": 3, "entries": ENTRIES, "tail_seconds": 0.5}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = make_tiny_project(tmp_path_factory.mktemp("train-demos"))
    convert_source(ROOT / "models" / "tiny-arc", root / "models" / "converted" / "tiny-arc")
    return root


def _job(root, **params):
    return TrainJob.from_params(
        {**TINY_PARAMS, "checkpoint_every": 2, **params}, "tiny-base", root=root, arc="tiny-arc"
    )


def _run(root, **params) -> str:
    out = io.StringIO()
    assert _job(root, **params).run(out) == 0
    return out.getvalue()


def _stems(folder, suffix=".mp3"):
    return sorted(p.stem for p in folder.glob(f"*{suffix}"))


def _checkpoint(root, name, step):
    return next(p for p in list_checkpoints(root / "runs" / name) if f"step={step}-" in p.name)


def test_demos_every_k_steps_after_the_save_bit_exact_and_resumable(project):
    demos = project / "runs" / "with-demos" / "demos"
    first = _run(project, name="with-demos", max_steps=6, demos=DEMOS)
    expected = ["baseline_0", "baseline_1"] + [f"demo_{i}_{s:08d}" for i in (0, 1) for s in (0, 3, 6)]
    assert _stems(demos) == sorted(expected) and _stems(demos, ".json") == sorted(expected)
    assert (demos / "index.html").is_file() and (demos / "loss_by_timestep.bin").is_file()
    assert json.loads((demos / "demo_1_00000003.json").read_text())["arc"] is True  # merged from a temp copy
    lines = first.splitlines()
    saved6 = lines.index("✓ Saved checkpoint -- with-demos-step=6-epoch=1.safetensors")
    assert saved6 < lines.index("demo 0 (base): demo_0_00000006.mp3, 1.0 s")  # after the save of its step
    assert lines.index("demo 0 (base): demo_0_00000000.mp3, 1.0 s") < lines.index(
        "✓ Saved checkpoint -- with-demos-step=2-epoch=0.safetensors"
    )  # step 0: before training

    # resumed with other demo settings: no restart, nothing rendered twice, a torn demo filled in
    (demos / "demo_0_00000006.json").unlink()  # as if killed while rendering it
    kept = {p.name: p.stat().st_mtime_ns for p in demos.glob("*.mp3") if p.stem != "demo_0_00000006"}
    again = _run(project, name="with-demos", max_steps=9, demos={**DEMOS, "wav": True})
    assert "resume: continuing from with-demos-step=6-epoch=1.safetensors" in again
    assert "demo 0 (base): demo_0_00000006.mp3" in again and "demo_1_00000006.mp3" not in again
    assert kept == {p.name: p.stat().st_mtime_ns for p in demos.glob("*.mp3") if p.name in kept}
    assert _stems(demos, ".wav") == ["demo_0_00000006", "demo_0_00000009", "demo_1_00000009"]
    lines = again.splitlines()
    assert lines.index("✓ Saved checkpoint -- with-demos-step=9-epoch=3.safetensors (final)") < lines.index(
        "demo 1 (ARC): demo_1_00000009.mp3, 1.0 s"
    )

    # the same 9 steps without demos and without the resume: the same bytes
    _run(project, name="no-demos", max_steps=9)
    assert not (project / "runs" / "no-demos" / "demos" / "index.html").exists()
    for step in (6, 9):
        a, b = _checkpoint(project, "with-demos", step), _checkpoint(project, "no-demos", step)
        assert a.read_bytes() == b.read_bytes(), step
        assert resume_files(a)[0].read_bytes() == resume_files(b)[0].read_bytes(), step
    assert (project / "models" / "lora" / "with-demos.safetensors").read_bytes() == (
        project / "models" / "lora" / "no-demos.safetensors"
    ).read_bytes()


def test_demos_and_their_inputs_stay_out_of_the_fingerprint(project, tmp_path):
    root = tmp_path / "root"
    for name in ("data", "models"):
        shutil.copytree(project / name, root / name, symlinks=True)
    shutil.copyfile(ROOT / "dvc.yaml", root / "dvc.yaml")

    def key(**params):
        return fingerprint(_job(root, **params).fingerprint_payload())

    off = key(demos={"every": 0})
    assert key(demos=DEMOS) == off == key()
    (root / "sa3mlx" / "sample").mkdir(parents=True)
    (root / "sa3mlx" / "sample" / "render.py").write_text("# changed rendering code\n")
    (root / "models" / "converted" / "tiny-arc" / "extra.txt").write_text("another ARC model\n")
    assert key(demos=DEMOS) == off
    (root / "sa3mlx" / "sample" / "shifts.py").write_text("# training code\n")
    assert key(demos=DEMOS) != off
    assert "demos" not in _job(root).cfg.fingerprint_dict()


IMPORTED = """import json, sys, sa3mlx
def files():
    return sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("sa3mlx"))
import sa3mlx.train.session, sa3mlx.train.loop, sa3mlx.train.resume, sa3mlx.train.metrics
training = files()
import sa3mlx.train.job
print(json.dumps([training, files()]))
"""


def _covered(path: str, deps) -> bool:
    return any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps)


def test_train_stage_declares_the_demo_params_and_code():
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]
    assert {"train.demos", "model.arc"} <= set(stage["params"])
    assert set(DEMO_DEPS) <= set(stage["deps"])
    result = subprocess.run([sys.executable, "-c", IMPORTED], capture_output=True, text=True, check=True, cwd=ROOT)
    training, everything = (
        [Path(f).relative_to(ROOT).as_posix() for f in files] for files in json.loads(result.stdout)
    )
    assert [f for f in everything if not _covered(f, stage["deps"])] == []  # all code train runs is a dep
    assert [f for f in training if _covered(f, DEMO_DEPS)] == []  # no training code escapes the fingerprint


def test_settings_are_checked_before_training(project):
    assert not DemoSettings.from_params({"every": 0, "entries": ENTRIES}).on
    assert not DemoSettings.from_params({"every": 5}).on  # no entries: nothing to render
    with pytest.raises(ValueError, match=r"train.demos.evry: unknown key"):
        DemoSettings.from_params({"evry": 5})
    with pytest.raises(ValueError, match="unknown field"):
        DemoSettings.from_params({"every": 5, "entries": [{"prompt": "x", "sconds": 1}]})
    job = _job(project, demos=DEMOS)
    with pytest.raises(ArtifactError, match=r"converted/missing: missing \(train.demos has ARC entries"):
        TrainDemos(job.demos, None, project / "x", job.model_dir, project / "models" / "converted" / "missing")
