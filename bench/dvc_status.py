"""No-op `dvc status` / `dvc repro` on a synthetic 10,000-file corpus, per-file vs sharded data layout.

    python bench/dvc_status.py [--files 10000] [--layout both|files|shards] [--shards 256] [--repeats 3]

Builds, in a throwaway git+dvc repo, the pipeline's data layout with tiny files (DVC's cost is
per file, not per byte) and three stages whose commands do nothing (`true`); their outputs are
recorded with `dvc commit`, so the timings are DVC's alone:

    normalize: data/raw            -> data/normalized
    encode:    data/normalized     -> data/latents
    train:     data/latents        -> models/lora/adapter.safetensors

`files`:  data/raw N files; data/normalized N wav + N json + report.json; data/latents N npy + N json
          + details.json (the per-file layout of the stages today: 4N + N raw files).
`shards`: data/raw N files (the user's drop folder stays as it is); data/normalized and data/latents
          hold `--shards` uncompressed tar shards (an item goes to the shard its path hashes to) whose
          members are exactly the per-file layout (`tar -xf` gives the underfit npy+json tree back),
          plus index.json (member -> shard, byte offset, size: one item is one seek, no extraction).

Times are wall seconds of the `dvc` command line (interpreter start-up included), medians of
`--repeats` runs after one warm-up run; the target is <= 5 s on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

DVC_YAML = """stages:
  normalize:
    cmd: "true"
    deps: [data/raw]
    outs: [data/normalized]
  encode:
    cmd: "true"
    deps: [data/normalized]
    outs: [data/latents]
  train:
    cmd: "true"
    deps: [data/latents]
    outs: [models/lora/adapter.safetensors]
"""
FOLDER_SIZE = 100  # clips per sub-folder of data/raw, like a corpus of albums or sessions


def sh(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout + result.stderr


def clip_names(count: int) -> list[str]:
    return [f"set{i // FOLDER_SIZE:03d}/clip{i:05d}" for i in range(count)]


def clip_files(name: str, index: int) -> dict[str, dict[str, bytes]]:
    """Tiny but distinct contents of one clip in each folder, keyed by member name."""
    wav = b"RIFF" + index.to_bytes(4, "little") + b"WAVEfmt " + bytes(48)
    latent = io.BytesIO()
    np.save(latent, np.full((16, 2), index, dtype=np.float32))
    sidecar = {"relpath": f"{name}.npy", "prompt": f"clip {index}", "latent_shape": [16, 2]}
    return {
        "raw": {f"{name}.wav": wav},
        "normalized": {f"{name}.wav": wav[::-1], f"{name}.json": json.dumps({"prompt": f"clip {index}"}).encode()},
        "latents": {f"{name}.npy": latent.getvalue(), f"{name}.json": json.dumps(sidecar).encode()},
    }


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def bucket(rel: str, shards: int) -> int:
    """Shard of a member: a hash of its path without suffix, so an item's audio/latent and json share a
    shard and adding or changing one item rewrites one shard (one new DVC object) and no other."""
    stem = rel.rsplit(".", 1)[0]
    return int.from_bytes(hashlib.sha1(stem.encode()).digest()[:4], "big") % shards


def write_shards(folder: Path, files: dict[str, bytes], shards: int) -> None:
    """Deterministic tar shards (sorted members, fixed mtime and owner) and an index of member offsets."""
    (folder / "shards").mkdir(parents=True)
    groups: dict[int, list[str]] = {}
    for rel in sorted(files):
        groups.setdefault(bucket(rel, shards), []).append(rel)
    index = {}
    for number, names in sorted(groups.items()):
        shard = f"shards/{number:03d}.tar"
        with tarfile.open(folder / shard, "w", format=tarfile.USTAR_FORMAT) as tar:
            for rel in names:
                info = tarfile.TarInfo(rel)
                info.size, info.mtime, info.mode = len(files[rel]), 0, 0o644
                tar.addfile(info, io.BytesIO(files[rel]))
        with tarfile.open(folder / shard) as tar:
            index.update({m.name: [shard, m.offset_data, m.size] for m in tar.getmembers()})
    (folder / "index.json").write_text(json.dumps(index, sort_keys=True))
    for rel in names[:3]:  # the index reads members back with one seek each
        shard, offset, size = index[rel]
        with open(folder / shard, "rb") as f:
            f.seek(offset)
            assert f.read(size) == files[rel]


def build_corpus(root: Path, count: int, layout: str, shards: int) -> int:
    """Write the three data folders and the adapter; returns the number of files DVC tracks."""
    folders: dict[str, dict[str, bytes]] = {"raw": {}, "normalized": {}, "latents": {}}
    for index, name in enumerate(clip_names(count)):
        for folder, files in clip_files(name, index).items():
            folders[folder].update(files)
    write_files(root / "data/raw", folders["raw"])
    for folder, summary in (("normalized", "report.json"), ("latents", "details.json")):
        out = root / "data" / folder
        if layout == "files":
            write_files(out, folders[folder])
        else:
            write_shards(out, folders[folder], shards)
        (out / summary).write_text(json.dumps({"num_files": count}))
    (root / "models/lora").mkdir(parents=True)
    (root / "models/lora/adapter.safetensors").write_bytes(b"adapter")
    return sum(1 for p in (root / "data").rglob("*") if p.is_file()) + 1


def timed(cmd: list[str], cwd: Path, repeats: int, check) -> list[float]:
    sh(cmd, cwd)  # warm-up: the first call after a build fills DVC's state database
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = sh(cmd, cwd)
        times.append(time.perf_counter() - start)
        check(out)
    return times


def no_op_status(out: str) -> None:
    assert "Data and pipelines are up to date." in out, out


def no_op_repro(out: str) -> None:
    assert "Running stage" not in out and "didn't change, skipping" in out, out


def bench_layout(count: int, layout: str, shards: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"dvc-bench-{layout}-") as tmp:
        root = Path(tmp)
        sh(["git", "init", "-q"], root)
        sh(["dvc", "init", "-q"], root)
        sh(["dvc", "config", "core.analytics", "false"], root)
        start = time.perf_counter()
        tracked = build_corpus(root, count, layout, shards)
        built = time.perf_counter() - start
        (root / "dvc.yaml").write_text(DVC_YAML)
        start = time.perf_counter()
        sh(["dvc", "commit", "-f", "-q"], root)
        committed = time.perf_counter() - start
        status = timed(["dvc", "status"], root, repeats, no_op_status)
        repro = timed(["dvc", "repro"], root, repeats, no_op_repro)
        empty = timed(["dvc", "config", "core.analytics"], root, repeats, lambda out: None)
    return {
        "layout": layout,
        "files": tracked,
        "build": built,
        "commit": committed,
        "status": status,
        "repro": repro,
        "startup": statistics.median(empty),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=10_000, help="clips in the corpus")
    parser.add_argument("--layout", choices=("both", "files", "shards"), default="both")
    parser.add_argument("--shards", type=int, default=256, help="tar shards per folder (hash buckets)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    layouts = ("files", "shards") if args.layout == "both" else (args.layout,)
    print(
        f"dvc {sh(['dvc', '--version'], Path.cwd()).strip()}, {os.cpu_count()} cores, {args.files} clips, "
        f"medians of {args.repeats}; target <= 5 s"
    )
    for layout in layouts:
        r = bench_layout(args.files, layout, args.shards, args.repeats)
        runs = lambda key: ", ".join(f"{t:.2f}" for t in r[key])  # noqa: E731
        print(
            f"{layout:>6}: {r['files']:6d} tracked files | no-op status {statistics.median(r['status']):5.2f} s "
            f"({runs('status')}) | no-op repro {statistics.median(r['repro']):5.2f} s ({runs('repro')}) | "
            f"dvc start-up {r['startup']:.2f} s | build {r['build']:.1f} s, dvc commit {r['commit']:.1f} s"
        )


if __name__ == "__main__":
    main()
