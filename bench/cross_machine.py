"""Which stage outputs depend on the BLAS kernel: the pipeline reproduced in clean copies under different
OpenBLAS kernels (as different CPUs would pick), and each stage's output hashes compared.

    python bench/cross_machine.py [--cores Haswell,Sandybridge]

Each run sets OPENBLAS_CORETYPE (the kernel another CPU family would use) for the whole `dvc repro`.
Prints, per stage, whether its outputs are byte-identical to the machine's own kernel's, then
`RESULT {json}` with the stages that differ.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from dvc_project import make_project  # noqa: E402


def stage_outputs(project: Path) -> dict[str, dict[str, str]]:
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    return {name: {o["path"]: o.get("md5", "") for o in stage.get("outs", [])} for name, stage in lock.items()}


def reproduce(root: Path, label: str, coretype: str | None) -> dict:
    project = make_project(root / label)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    result = subprocess.run(["dvc", "repro", "-q"], cwd=project, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"dvc repro ({label}) failed:\n{result.stdout}\n{result.stderr}")
    return stage_outputs(project)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cores", default="Haswell,Sandybridge", help="OPENBLAS_CORETYPE values to compare")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sa3mlx-xmachine-") as tmp:
        native = reproduce(Path(tmp), "native", None)
        differ = {}
        for core in args.cores.split(","):
            other = reproduce(Path(tmp), core, core)
            differ[core] = [s for s in native if native[s] != other[s]]
            for stage in native:
                same = "identical" if native[stage] == other[stage] else "DIFFERENT"
                print(f"{core:>12}: {stage:<10} {same}")
    print("RESULT " + json.dumps({"stages_differing_by_blas_kernel": differ}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
