"""No-op `dvc status` / `dvc repro` and objects pushed after one clip changes, per data layout.

    python bench/dvc_status.py [--clips 10000] [--big 100000] [--repeats 3] [--layouts files,shards]

Part 1, the real pipeline at `--clips` clips, once per layout (`normalize.layout` = `encode.layout`):
a throwaway git+dvc copy of this project (dvc.yaml, params.yaml, .dvcignore, stages/, sa3mlx/, the
tiny models) whose data/raw/ is a synthetic corpus of 0.1 s stereo clips in folders of 100, committed
to git like the embedded demo corpus; `dvc repro encode` runs the real convert, normalize and encode
stages, so data/normalized and data/latents are exactly what the stages write. Timed: the first run,
no-op `dvc status encode` (that stage: its code, model, params and data/normalized dependencies and
data/latents), `dvc status --with-deps encode` (convert, normalize and encode: data/raw included) and
`dvc repro encode`; then `dvc push` to a local remote, one raw clip is changed, `dvc repro encode`
(which must normalize 1 and encode 1) and `dvc push` again: the objects that second push uploads.

Part 2, `--big` clips (sharded layout only), tiny synthetic members: data/normalized and data/latents
written by the stages' own writer (sa3mlx/runtime/shards.py TreeWriter, members and summary files as
the stages name them) under stages whose commands do nothing, recorded with `dvc commit`; the same
timings (data/raw not git-ignored, as when committed to git), no-op `dvc status` again once data/raw
is tracked by `dvc add` (what the README advises for a large corpus), and the objects pushed after
one member changes.

Times are wall seconds of the `dvc` command line (interpreter start-up included) and its CPU seconds
(user + system: what a busy machine stretches the wall time from); every figure is reported as
min/median/max of `--repeats` runs after one warm-up run, with the load average around it. Last line:
RESULT {json}. Targets (2 cores): shards at 10k <= 2 s, at 100k <= 10 s; one changed clip pushes <= 3
objects.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sa3mlx.audio.normalize import REPORT_NAME  # noqa: E402
from sa3mlx.audio.write import write_float_wav  # noqa: E402
from sa3mlx.data.encode import DETAILS_FILE  # noqa: E402
from sa3mlx.runtime.previous import locked_dir_md5  # noqa: E402
from sa3mlx.runtime.shards import TreeWriter  # noqa: E402

PROJECT = ("dvc.yaml", "params.yaml", ".dvcignore", "stages", "sa3mlx", "models/tiny-base", "models/tiny-arc")
FOLDER_SIZE = 100  # clips per sub-folder of data/raw, like a corpus of albums or sessions
CLIP_SAMPLES = 4410  # 0.1 s at 44.1 kHz: one latent after normalize
DATA_ONLY_DVC_YAML = """stages:
  normalize:
    cmd: "true"
    deps: [data/raw]
    outs: [data/normalized]
  encode:
    cmd: "true"
    deps: [data/normalized]
    outs: [data/latents]
"""


def sh(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout + result.stderr


def clip_names(count: int) -> list[str]:
    return [f"set{i // FOLDER_SIZE:04d}/clip{i:06d}" for i in range(count)]


def init_repo(root: Path) -> None:
    for cmd in (
        ["git", "init", "-q"],
        ["git", "config", "user.email", "bench@sa3mlx.invalid"],
        ["git", "config", "user.name", "bench"],
        ["dvc", "init", "-q"],
        ["dvc", "config", "core.analytics", "false"],
    ):
        sh(cmd, root)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], cwd: Path, repeats: int, check) -> dict[str, list[float]]:
    """Wall and CPU seconds of `repeats` runs of `cmd`, and the 1-minute load average before each."""
    sh(cmd, cwd)  # warm-up: the first call after a build fills DVC's state database
    times = {"wall": [], "cpu": [], "load": []}
    for _ in range(repeats):
        times["load"].append(os.getloadavg()[0])
        cpu, start = children_cpu(), time.perf_counter()
        out = sh(cmd, cwd)
        times["wall"].append(time.perf_counter() - start)
        times["cpu"].append(children_cpu() - cpu)
        check(out)
    return times


def no_op_status(out: str) -> None:
    assert "Data and pipelines are up to date." in out, out


def no_op_repro(out: str) -> None:
    assert "Running stage" not in out, out


def remote_objects(remote: Path) -> set[str]:
    return {p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file()}


def pushed(root: Path, remote: Path) -> dict[str, list[str]]:
    """`dvc push`; the objects it uploaded, by output folder (its files and its `.dir` listing)."""
    before = remote_objects(remote)
    sh(["dvc", "push", "-q"], root)
    new = remote_objects(remote) - before
    by_folder = {}
    for folder in ("data/normalized", "data/latents"):
        listing = locked_dir_md5(root, folder)
        listing_object = f"files/md5/{listing[:2]}/{listing[2:]}"
        entries = json.loads((remote / listing_object).read_text())
        mine = {listing_object} | {f"files/md5/{e['md5'][:2]}/{e['md5'][2:]}" for e in entries}
        by_folder[folder] = sorted(new & mine)
        new -= mine
    by_folder["other"] = sorted(new)
    return by_folder


def data_only_status(root: Path, repeats: int) -> dict[str, list[float]]:
    """The stage-written folders moved into a repo whose stages are data-only (`true` commands, data deps):
    what the layout itself costs, without the real pipeline's code and model dependencies."""
    other = root.parent / "data-only"
    other.mkdir()
    init_repo(other)
    shutil.move(root / "data", other / "data")
    shutil.rmtree(other / "data" / "encode_cache", ignore_errors=True)
    (other / "dvc.yaml").write_text(DATA_ONLY_DVC_YAML)
    shutil.copyfile(ROOT / ".dvcignore", other / ".dvcignore")
    sh(["dvc", "commit", "-f", "-q"], other)
    return timed(["dvc", "status"], other, repeats, no_op_status)


def noise_clip(path: Path, seed: int) -> None:
    audio = (0.1 * np.random.default_rng(seed).standard_normal((CLIP_SAMPLES, 2))).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_float_wav(path, audio, 44100)


def set_layout(params: Path, layout: str) -> None:
    text = params.read_text()
    text, count = re.subn(r"(\n  layout: )\w+", rf"\g<1>{layout}", text)
    assert count == 2, "params.yaml: expected normalize.layout and encode.layout"
    params.write_text(text)


def bench_real(clips: int, layout: str, repeats: int, log) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"dvc-bench-{layout}-") as tmp:
        root, remote = Path(tmp) / "repo", Path(tmp) / "remote"
        for name in PROJECT:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copyfile
            copy(
                ROOT / name,
                root / name,
                **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
            )
        for index, name in enumerate(clip_names(clips)):
            noise_clip(root / "data" / "raw" / f"{name}.wav", index)
        set_layout(root / "params.yaml", layout)
        init_repo(root)
        sh(["dvc", "remote", "add", "-d", "bench", str(remote)], root)
        sh(["git", "add", "-A"], root)
        sh(["git", "commit", "-q", "-m", "bench"], root)
        start = time.perf_counter()
        sh(["dvc", "repro", "encode"], root)
        first = time.perf_counter() - start
        tracked = sum(1 for d in ("normalized", "latents") for p in (root / "data" / d).rglob("*") if p.is_file())
        log(f"{layout}: first dvc repro encode {first:.0f} s, {tracked} files in data/normalized + data/latents")
        status = timed(["dvc", "status", "encode"], root, repeats, no_op_status)
        with_deps = timed(["dvc", "status", "--with-deps", "encode"], root, repeats, no_op_status)
        repro = timed(["dvc", "repro", "encode"], root, repeats, no_op_repro)
        pushed(root, remote)
        noise_clip(root / "data" / "raw" / f"{clip_names(clips)[clips // 2]}.wav", clips + 1)
        start = time.perf_counter()
        out = sh(["dvc", "repro", "encode"], root)
        incremental = time.perf_counter() - start
        assert "normalize: 1 decoded and resampled" in out and ": 1 encoded," in out, out
        objects = pushed(root, remote)
        data_only = data_only_status(root, repeats)
    return {
        "layout": layout,
        "files": tracked,
        "data_only_status": data_only,
        "first_repro": first,
        "status": status,
        "with_deps_status": with_deps,
        "repro": repro,
        "one_clip_repro": incremental,
        "one_clip_objects": objects,
    }


def synthetic_folders(count: int, changed: int | None = None) -> dict[str, dict[str, bytes]]:
    """Tiny but distinct members of each derived folder, named as the stages name them."""
    folders: dict[str, dict[str, bytes]] = {"normalized": {}, "latents": {}}
    for index, name in enumerate(clip_names(count)):
        value = -index if index == changed else index
        latent = io.BytesIO()
        np.save(latent, np.full((16, 2), value, dtype=np.float32))
        folders["normalized"][f"{name}.wav"] = b"RIFF" + value.to_bytes(8, "little", signed=True) + bytes(40)
        folders["normalized"][f"{name}.json"] = json.dumps({"prompt": f"clip {index}"}).encode()
        folders["latents"][f"{name}.npy"] = latent.getvalue()
        folders["latents"][f"{name}.json"] = json.dumps({"relpath": f"{name}.npy", "prompt": f"clip {index}"}).encode()
    return folders


def write_synthetic(root: Path, count: int, changed: int | None = None) -> None:
    for folder, members in synthetic_folders(count, changed).items():
        writer = TreeWriter(root / "data" / folder, "shards")
        for name, data in members.items():
            writer.add_bytes(name, data)
        summary = REPORT_NAME if folder == "normalized" else DETAILS_FILE
        writer.finish(summary, {"num_files": count, "changed": changed})


def bench_synthetic(count: int, repeats: int, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="dvc-bench-big-") as tmp:
        root, remote = Path(tmp) / "repo", Path(tmp) / "remote"
        root.mkdir()
        init_repo(root)
        sh(["dvc", "remote", "add", "-d", "bench", str(remote)], root)
        for name in clip_names(count):
            path = root / "data" / "raw" / f"{name}.wav"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"RIFF" + name.encode())
        write_synthetic(root, count)
        (root / "dvc.yaml").write_text(DATA_ONLY_DVC_YAML)
        shutil.copyfile(ROOT / ".dvcignore", root / ".dvcignore")
        sh(["dvc", "commit", "-f", "-q"], root)
        log(f"shards, {count} synthetic clips: committed")
        status = timed(["dvc", "status"], root, repeats, no_op_status)
        repro = timed(["dvc", "repro"], root, repeats, no_op_repro)
        pushed(root, remote)
        write_synthetic(root, count, changed=count // 2)
        sh(["dvc", "commit", "-f", "-q"], root)
        objects = pushed(root, remote)
        sh(["dvc", "add", "-q", "data/raw"], root)
        log(f"shards, {count} synthetic clips: data/raw tracked by dvc add")
        raw_added = timed(["dvc", "status"], root, repeats, no_op_status)
    return {
        "layout": "shards",
        "files": None,
        "status": status,
        "raw_dvc_add_status": raw_added,
        "repro": repro,
        "one_clip_objects": objects,
    }


def spread(times: dict[str, list[float]]) -> str:
    """`wall min/median/max s (CPU min/median/max s, load a-b)`."""

    def three(values: list[float]) -> str:
        return f"{min(values):.2f}/{statistics.median(values):.2f}/{max(values):.2f}"

    load = times["load"]
    return f"{three(times['wall'])} s (CPU {three(times['cpu'])} s, load {min(load):.1f}-{max(load):.1f})"


TIMINGS = {  # result key suffix: how the line names it
    "status": "no-op status",
    "with_deps_status": "no-op status --with-deps",
    "data_only_status": "data-only status",
    "raw_dvc_add_status": "status with data/raw dvc-added",
    "repro": "no-op repro",
}


def per_folder(objects: dict[str, list[str]]) -> int:
    return max(len(objects[folder]) for folder in ("data/normalized", "data/latents"))


def report(tag: str, r: dict) -> dict:
    """Print one layout's figures; its RESULT entries."""
    objects = r["one_clip_objects"]
    total = sum(len(v) for v in objects.values())
    folders = ", ".join(f"{folder} {len(v)}" for folder, v in objects.items())
    print(f"{tag}:")
    result = {}
    for key, label in TIMINGS.items():
        if key in r:
            print(f"  {label:>31}: {spread(r[key])}")
            result[f"{tag}_{key}_s"] = round(statistics.median(r[key]["wall"]), 2)
            result[f"{tag}_{key}_cpu_s"] = round(statistics.median(r[key]["cpu"]), 2)
    line = f"  one changed clip: {total} objects pushed ({folders})"
    if "first_repro" in r:
        line += f", its repro {r['one_clip_repro']:.1f} s (first run {r['first_repro']:.0f} s, {r['files']} files)"
    print(line)
    result[f"{tag}_one_clip_objects"] = total
    result[f"{tag}_one_clip_objects_per_folder"] = per_folder(objects)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=10_000, help="clips of the real-pipeline part")
    parser.add_argument("--big", type=int, default=100_000, help="clips of the synthetic part (0: skip)")
    parser.add_argument("--layouts", default="files,shards", help="layouts of the real-pipeline part")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"dvc {sh(['dvc', '--version'], ROOT).strip()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    load_before = os.getloadavg()[0]
    log = lambda text: print(text, flush=True)  # noqa: E731
    runs = [bench_real(args.clips, layout, args.repeats, log) for layout in args.layouts.split(",")]
    if args.big:
        runs.append({**bench_synthetic(args.big, args.repeats, log), "clips": args.big})
    result = {}
    for r in runs:
        clips = r.get("clips", args.clips)
        tag = f"{r['layout']}_{clips // 1000}k" if clips >= 1000 else f"{r['layout']}_{clips}"
        result.update(report(tag, r))
    shards = next((r for r in runs if r["layout"] == "shards" and "clips" not in r), None)
    if shards is not None:  # per derived folder: its shard, its summary file, DVC's listing of it
        result["one_clip_change_objects"] = per_folder(shards["one_clip_objects"])
    result["load_average"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]  # at the start, at the end
    print("RESULT " + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
