"""Incremental work survives `dvc pull` (issue 20), with real `dvc` and a local remote: a teammate's
fresh clone that pulled the outputs and adds one clip normalizes 1 file and encodes 1, the other
outputs byte-identical to the first clone's; a settings change of one stage recomputes all of that
stage; a damaged object in the DVC cache is recomputed, never copied. The sharded layout is used
here (the files layout goes through the same code: tests/test_reuse.py runs both)."""

import hashlib
import json
import re

import numpy as np
import pytest
from dvc_project import commit_all, fork, make_project, ran_stages, run

from sa3mlx.audio.write import write_float_wav
from sa3mlx.runtime.previous import previous_output
from sa3mlx.runtime.shards import ENCODE_DETAILS, INDEX_KEY, NORMALIZE_REPORT, SHARDS_DIR, open_tree

DONE = re.compile(r"Done in .+?: (\d+) encoded, (\d+) skipped, (\d+) errors")
NORMALIZED = re.compile(r"normalize: (\d+) decoded and resampled, (\d+) unchanged taken")


def set_params(repo, **layouts) -> None:
    """Rewrite `<section>.layout` in params.yaml, keeping its comments."""
    params = repo / "params.yaml"
    text = params.read_text()
    for section, value in layouts.items():
        text = re.sub(rf"(\n{section}:\n(?:  .*\n|\s*\n)*?  layout: )\w+", rf"\g<1>{value}", text)
    params.write_text(text)


def add_clip(repo, name="added.wav", seed=9):
    audio = (0.1 * np.random.default_rng(seed).standard_normal((3 * 44100, 2))).astype(np.float32)
    write_float_wav(repo / "data" / "raw" / name, audio, 44100)


SUMMARIES = {"normalized": NORMALIZE_REPORT, "latents": ENCODE_DETAILS}


def index_of(folder) -> dict:
    return json.loads((folder / SUMMARIES[folder.name]).read_text())[INDEX_KEY]


def shard_digests(folder) -> dict[str, str]:
    """{bucket: md5} of the shards a folder's index names."""
    index = index_of(folder)
    return {s.split("/")[-1][:3]: hashlib.md5((folder / s).read_bytes()).hexdigest() for s in index["shards"]}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The first clone: the sharded layout, `dvc repro encode`, committed and pushed to a local remote."""
    base = tmp_path_factory.mktemp("reuse")
    repo = make_project(base / "source")
    set_params(repo, normalize="shards", encode="shards")
    assert "layout: shards" in (repo / "params.yaml").read_text()
    run(["dvc", "repro", "encode"], repo)
    run(["dvc", "remote", "add", "-d", "team", str(base / "remote")], repo)
    commit_all(repo, "sharded data")
    run(["dvc", "push"], repo)
    return repo


def pulled_clone(source, path):
    run(["git", "clone", "-q", str(source), str(path)], path.parent)
    run(["dvc", "pull", "--with-deps", "encode"], path)
    assert not (path / "data" / "encode_cache").exists()  # machine-local: the clone has none
    assert "Running stage" not in run(["dvc", "repro", "encode"], path)
    return path


def test_a_pulled_clone_adding_one_clip_normalizes_one_and_encodes_one(source, tmp_path):
    clone = pulled_clone(source, tmp_path / "clone")
    add_clip(clone)
    out = run(["dvc", "repro", "encode"], clone)
    assert ran_stages(out) == ["normalize", "encode"]
    assert NORMALIZED.search(out).groups() == ("1", "9"), out
    assert DONE.search(out).groups() == ("1", "8", "0"), out
    for folder, member in (("normalized", "added.wav"), ("latents", "added.npy")):
        mine, theirs = shard_digests(clone / "data" / folder), shard_digests(source / "data" / folder)
        changed = {b for b in mine.keys() | theirs.keys() if mine.get(b) != theirs.get(b)}
        index = index_of(clone / "data" / folder)
        assert changed == {index["members"][member][0].split("/")[-1][:3]}, folder  # one shard, the new clip's
    # the same clip added in (a copy of) the first clone gives the same bytes
    first = fork(source, tmp_path / "first")
    add_clip(first)
    run(["dvc", "repro", "encode"], first)
    for folder in ("normalized", "latents"):
        assert shard_digests(clone / "data" / folder) == shard_digests(first / "data" / folder)

    # a change of one stage's settings: that stage recomputes everything, the other nothing
    run(["dvc", "repro", "-q", "encode"], clone)
    params = clone / "params.yaml"
    params.write_text(params.read_text().replace("chunk_above_seconds: 30", "chunk_above_seconds: 2"))
    out = run(["dvc", "repro", "encode"], clone)
    assert ran_stages(out) == ["encode"] and DONE.search(out).groups() == ("9", "0", "0"), out


def test_a_damaged_object_in_the_dvc_cache_is_recomputed_not_copied(source, tmp_path):
    clone = pulled_clone(source, tmp_path / "clone")
    latents = previous_output("data/latents", ENCODE_DETAILS, clone)
    span = latents.member("bass_line.npy")
    damaged = bytearray(span.path.read_bytes())
    damaged[span.offset + span.size // 2] ^= 0xFF
    span.path.chmod(0o644)
    span.path.write_bytes(bytes(damaged))
    in_that_shard = sum(
        1
        for name, entry in index_of(clone / "data" / "latents")["members"].items()
        if name.endswith(".npy") and entry[0] == latents._shard_spans["bass_line.npy"][0]
    )
    add_clip(clone)
    out = run(["dvc", "repro", "encode"], clone)
    assert DONE.search(out).groups() == (str(1 + in_that_shard), str(8 - in_that_shard), "0"), out
    assert "damaged in the DVC cache, encoded again: data/latents/" + SHARDS_DIR in out
    mine = open_tree(clone / "data" / "latents", ENCODE_DETAILS)
    theirs = open_tree(source / "data" / "latents", ENCODE_DETAILS)
    assert sorted(set(mine.names()) - set(theirs.names())) == ["added.json", "added.npy"]
    assert all(mine.read(name) == theirs.read(name) for name in theirs.names())  # recomputed = the original
