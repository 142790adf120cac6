"""The sharded layout of a derived data folder: stable bytes, one changed item = one rewritten shard,
atomic shards, one-seek reads, `tar -xf` = export = the files layout, and damage noticed."""

import hashlib
import io
import json
import re
import subprocess
from pathlib import Path, PurePosixPath

import numpy as np
import pytest

from sa3mlx import cli
from sa3mlx.runtime import shards as S
from sa3mlx.runtime.errors import ArtifactError, ParamError
from sa3mlx.runtime.layout import DVC_FILE

SUMMARY = S.ENCODE_DETAILS


def _npy(value: float, length: int = 3) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.full((2, length), value, np.float32))
    return buffer.getvalue()


def _items(count: int) -> dict[str, bytes]:
    members = {}
    for i in range(count):
        name = f"set{i % 3}/clip {i:02d}"
        members[f"{name}.npy"] = _npy(i)
        members[f"{name}.json"] = json.dumps({"prompt": f"clip {i}"}).encode()
    return members


def _write(root, members: dict[str, bytes], layout="shards"):
    writer = S.TreeWriter(root, layout)
    for name, data in members.items():
        writer.add_bytes(name, data)
    writer.finish(SUMMARY, {"num_files": len(members) // 2})
    return root


def _index(root) -> dict:
    return json.loads((root / SUMMARY).read_text())[S.INDEX_KEY]


def _digests(root) -> dict[str, str]:
    """{bucket: md5} of the shards the index names."""
    index = _index(root)
    return {
        PurePosixPath(shard).name[:3]: hashlib.md5((root / shard).read_bytes()).hexdigest() for shard in index["shards"]
    }


def test_members_read_back_with_one_seek_and_pairs_share_a_shard(tmp_path):
    members = _items(20)
    tree = S.open_tree(_write(tmp_path / "out", members), SUMMARY)
    assert tree.layout == "shards" and tree.names() == sorted(members)
    assert {name: tree.read(name) for name in tree.names()} == members
    assert S.shard_of("a/b.npy") == S.shard_of("a/b.json") != S.shard_of("a/c.npy")
    assert len(list((tmp_path / "out" / S.SHARDS_DIR).iterdir())) == len({S.shard_of(n) for n in members})
    index = _index(tmp_path / "out")
    shard, offset, size = index["members"]["set1/clip 04.npy"]
    with open(tmp_path / "out" / shard, "rb") as f:
        f.seek(offset)
        assert f.read(size) == members["set1/clip 04.npy"]
    latent = tree.span("set1/clip 04.npy").load_npy()
    assert isinstance(latent, np.memmap) and latent.tolist() == [[4.0] * 3] * 2


def test_same_members_same_bytes_and_one_change_rewrites_one_shard(tmp_path):
    members = _items(40)
    first = _digests(_write(tmp_path / "a", members))
    assert _digests(_write(tmp_path / "b", dict(reversed(members.items())))) == first  # order of adding is free
    changed = {**members, "set0/clip 03.npy": _npy(99)}
    added = {**members, "new/one.npy": _npy(7), "new/one.json": b"{}"}
    deleted = {k: v for k, v in members.items() if not k.startswith("set2/clip 05")}
    for variant, item in ((changed, "set0/clip 03"), (added, "new/one"), (deleted, "set2/clip 05")):
        after = _digests(_write(tmp_path / "a", variant))
        differ = {name for name in first.keys() | after.keys() if first.get(name) != after.get(name)}
        assert differ == {S.shard_of(item + ".npy")}, item
        _write(tmp_path / "a", members)
    assert _digests(tmp_path / "a") == first


def test_tar_extract_export_and_the_files_layout_agree(tmp_path):
    members = _items(12)
    sharded = _write(tmp_path / "sharded", members)
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    for shard in sorted((sharded / S.SHARDS_DIR).iterdir()):
        subprocess.run(["tar", "-xf", str(shard), "-C", str(extracted)], check=True)
    assert cli.main(["export", "latents", str(tmp_path / "exported"), "--from", str(sharded)]) == 0
    assert not (tmp_path / "exported" / "details.json").exists()  # the members only, as `tar -xf` gives
    files = _write(tmp_path / "files", members, "files")
    for root in (extracted, tmp_path / "exported", files):
        tree = S.open_tree(root, SUMMARY)
        assert tree.layout == "files" and {name: tree.read(name) for name in tree.names()} == members, root


def test_switching_layouts_leaves_no_stale_files(tmp_path):
    members = _items(5)
    root = _write(tmp_path / "out", members, "files")
    _write(root, members, "shards")
    assert sorted(p.name for p in root.iterdir()) == [SUMMARY, S.SHARDS_DIR]
    _write(root, members, "files")
    assert S.open_tree(root, SUMMARY).names() == sorted(members)
    assert not (root / S.SHARDS_DIR).exists() and S.INDEX_KEY not in json.loads((root / SUMMARY).read_text())


def test_a_crash_mid_write_leaves_the_old_consistent_folder(tmp_path, monkeypatch):
    members = _items(30)
    root = _write(tmp_path / "out", members)
    old = _digests(root)
    changed = {name: data + b" " if name.endswith(".json") else data for name, data in members.items()}
    packed, real = [], S.write_tar

    def crash_after_three(f, names, sources):
        if len(packed) == 3:
            raise KeyboardInterrupt
        packed.append(names)
        return real(f, names, sources)

    monkeypatch.setattr(S, "write_tar", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        _write(root, changed)
    assert _digests(root) == old  # the index still names the old shards, all there and intact
    tree = S.open_tree(root, SUMMARY)
    assert {name: tree.read(name) for name in tree.names()} == members
    assert len(list((root / S.SHARDS_DIR).iterdir())) == len(old) + 3  # the new ones: swept by the next run
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    monkeypatch.setattr(S, "write_tar", real)
    _write(root, changed)
    assert len(list((root / S.SHARDS_DIR).iterdir())) == len(old)
    assert {name: S.open_tree(root, SUMMARY).read(name) for name in changed} == changed


def _in_a_project(tmp_path: Path) -> Path:
    """`tmp_path` as a DVC project whose stage `make` outputs `out` (so the fix is `dvc checkout out`)."""
    (tmp_path / DVC_FILE).write_text("stages: {}\n")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  make:\n    outs:\n    - path: out\n")
    return tmp_path / "out"


def test_a_shard_that_does_not_match_its_index_is_an_error_naming_the_fix(tmp_path):
    root = _write(_in_a_project(tmp_path), _items(4))
    shard = sorted((root / S.SHARDS_DIR).iterdir())[0]
    shard.write_bytes(shard.read_bytes()[:-512])
    with pytest.raises(
        ArtifactError,
        match=rf"out/shards/{shard.name}: damaged shard \(\d+ bytes, the index in "
        rf"{SUMMARY} says \d+\); restore it with `dvc checkout out`",
    ):
        S.open_tree(root, SUMMARY)


def test_a_damaged_member_is_an_error_naming_its_shard_member_and_the_fix(tmp_path):
    root = _write(_in_a_project(tmp_path), _items(4))
    name = S.open_tree(root, SUMMARY).names()[0]
    span = S.open_tree(root, SUMMARY).span(name)
    with open(span.path, "r+b") as f:  # the member's bytes cut short: the shard ends inside them
        f.truncate(span.offset + 1)
    with pytest.raises(
        ArtifactError,
        match=rf"shards/.*\.tar: damaged member {re.escape(name)} \(truncated: 1 of "
        r".*`dvc checkout out`",
    ):
        span.read()
    index = json.loads((root / SUMMARY).read_text())
    index[S.INDEX_KEY]["members"] = "garbage"
    (root / SUMMARY).write_text(json.dumps(index))
    with pytest.raises(ArtifactError, match=rf"out/{SUMMARY}: damaged shard index .*`dvc checkout out`"):
        S.open_tree(root, SUMMARY)


@pytest.mark.parametrize("layout", ["files", "shards"])
@pytest.mark.parametrize(
    ("member", "what", "damage"),
    [
        ("a.json", "latent sidecar", lambda data: data.replace(b"seconds_total", b"seconds_tota!")),
        ("a.json", "latent sidecar", lambda data: data.replace(b"{", b"[", 1)),
        ("a.npy", "latents", lambda data: data.replace(b"descr", b"dexcr", 1)),
    ],
)
def test_damaged_latents_and_sidecars_are_named_with_the_fix_in_both_layouts(tmp_path, layout, member, what, damage):
    """The dataset's one-line refusals of issue 19 hold in the shards layout too: they name the shard
    and the member, and the fix (same-size damage, so the index still matches its shards)."""
    from sa3mlx.data.dataset import PreEncodedDataset

    sidecar = {"seconds_total": 1.0, "padding_mask": [1, 1, 1]}
    members = {"a.npy": _npy(1.0), "a.json": json.dumps(sidecar).encode()}
    members[member] = damage(members[member])
    root = _write(_in_a_project(tmp_path), members, layout)
    shard_file = r"shards/[^:]+\.tar"
    where = rf"out/{shard_file}: damaged {what} {member} " if layout == "shards" else rf"out/{member}: damaged {what} "
    with pytest.raises(ArtifactError, match=where + r"\(.*\); restore it with `dvc checkout out`"):
        PreEncodedDataset(root, 3)


def test_layout_choice():
    assert S.choose_layout("auto", S.AUTO_SHARDS_ABOVE, "x") == "files"
    assert S.choose_layout("auto", S.AUTO_SHARDS_ABOVE + 1, "x") == "shards"
    assert S.choose_layout("files", 10**6, "x") == "files"
    with pytest.raises(ParamError, match="params.yaml: encode.layout: expected one of files, shards, auto, got 'tar'"):
        S.choose_layout("tar", 1, "encode.layout")


def test_training_over_files_or_shards_gives_bit_identical_adapters(tmp_path):
    from test_train_loop_fake import TINY_PARAMS, make_tiny_project, reproducible_prompt_encoding

    from sa3mlx.train.job import TrainJob

    restore = reproducible_prompt_encoding()
    try:
        adapters = []
        for layout in ("files", "shards"):
            project = make_tiny_project(tmp_path / layout)
            latents = project / "data" / "latents"
            if layout == "shards":
                members = S.open_tree(latents, SUMMARY)
                packed = {name: members.read(name) for name in members.names()}
                _write(latents, packed)
                assert S.open_tree(latents, SUMMARY).layout == "shards" and not list(latents.glob("*.npy"))
            job = TrainJob.from_params(
                {**TINY_PARAMS, "max_steps": 3, "checkpoint_every": 3}, "tiny-base", root=project
            )
            assert job.run(io.StringIO()) == 0
            adapters.append((project / "models" / "lora" / f"{TINY_PARAMS['name']}.safetensors").read_bytes())
        assert adapters[0] == adapters[1]
    finally:
        restore()
