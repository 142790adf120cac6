"""Pre-encoded dataset: discovery, crop/pad semantics, oversampling, seeded resumable batches."""

import json

import numpy as np
import pytest

from sa3mlx.data import dataset as D
from sa3mlx.data.prompts import PromptTemplate
from sa3mlx.runtime.errors import ArtifactError

C = 4


def _write(root, relpath, length, valid=None, seconds=None, **tags):
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    latents = np.arange(C * length, dtype=np.float32).reshape(C, length) + 1000 * len(relpath)
    np.save(path, latents)
    valid = length if valid is None else valid
    meta = {
        "path": f"/audio/{relpath}",
        "relpath": relpath,
        "src_relpath": relpath.replace(".npy", ".wav"),
        "seconds_total": seconds if seconds is not None else round(valid * 4096 / 44100, 3),
        "seconds_start": 0,
        "audio_samples": valid * 4096,
        "latent_shape": [C, length],
        "padding_mask": [1] * valid + [0] * (length - valid),
        **tags,
    }
    path.with_suffix(".json").write_text(json.dumps(meta))
    return latents


def test_discovery_skips_silence_and_sorts(tmp_path):
    _write(tmp_path, "b.npy", 8)
    _write(tmp_path, "sub/a.npy", 8)
    np.save(tmp_path / "silence.npy", np.zeros((1, C, 3), np.float32))
    assert [f.relpath for f in D.find_latents(tmp_path)] == ["b.npy", "sub/a.npy"]
    np.save(tmp_path / "orphan.npy", np.zeros((C, 2), np.float32))
    with pytest.raises(ArtifactError, match="orphan.json: missing"):
        D.find_latents(tmp_path)
    with pytest.raises(ValueError, match="no pre-encoded"):
        D.find_latents(_empty_folder(tmp_path))


def _empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def test_random_crop_stays_inside_the_valid_region(tmp_path):
    latents = _write(tmp_path, "long.npy", 40, valid=25, seconds=600.0)
    ds = D.PreEncodedDataset(tmp_path, crop_length=10, random_crop=True)
    starts = set()
    for seed in range(200):
        ex = ds.example(0, np.random.default_rng(seed))
        start = ex.info["latent_crop_start"]
        starts.add(start)
        np.testing.assert_array_equal(ex.latents, latents[:, start : start + 10])
        assert ex.latents.dtype == np.float32 and ex.padding_mask.dtype == bool
        assert ex.padding_mask.tolist() == [start + i <= 24 for i in range(10)]
        assert ex.info["seconds_total"] == 600.0 and ex.info["latent_crop_length"] == 10
        assert "padding_mask" not in ex.info
    assert starts == set(range(0, 24 - 10 + 1))  # randint(0, last_valid − crop), inclusive


def test_start_crop_and_short_valid_region_start_at_zero(tmp_path):
    _write(tmp_path, "a.npy", 40, valid=8)
    assert (
        D.PreEncodedDataset(tmp_path, 10, random_crop=True)
        .example(0, np.random.default_rng(1))
        .info["latent_crop_start"]
        == 0
    )  # last valid index 7 <= crop
    _write(tmp_path, "a.npy", 40)
    assert (
        D.PreEncodedDataset(tmp_path, 10, random_crop=False)
        .example(0, np.random.default_rng(1))
        .info["latent_crop_start"]
        == 0
    )


def test_short_clip_is_padded_with_silence_or_zeros(tmp_path):
    latents = _write(tmp_path, "short.npy", 5)
    ex = D.PreEncodedDataset(tmp_path, 12).example(0, np.random.default_rng(0))
    np.testing.assert_array_equal(ex.latents[:, :5], latents)
    assert not ex.latents[:, 5:].any() and ex.padding_mask.tolist() == [True] * 5 + [False] * 7
    silence = np.arange(C * 3, dtype=np.float32).reshape(1, C, 3) - 50
    np.save(tmp_path / "silence.npy", silence)
    ex = D.PreEncodedDataset(tmp_path, 12).example(0, np.random.default_rng(0))
    np.testing.assert_array_equal(ex.latents[:, 5:], np.tile(silence[0], (1, 3))[:, :7])
    assert ex.padding_mask.tolist() == [True] * 5 + [False] * 7
    exact = D.PreEncodedDataset(tmp_path, 5).example(0, np.random.default_rng(0))
    np.testing.assert_array_equal(exact.latents, latents)


def test_small_set_is_oversampled_with_replacement(tmp_path):
    for name in ("a.npy", "b.npy"):
        _write(tmp_path, name, 16, genre="ambient")
    ds = D.PreEncodedDataset(tmp_path, 8)
    sampler = D.EpochSampler(len(ds), batch_size=4, seed=42)
    assert sampler.oversampled and sampler.samples_per_epoch == 400 and sampler.batches_per_epoch == 100
    batches = list(D.BatchLoader(ds, sampler).epoch())
    assert len(batches) == 100 and all(b.latents.shape == (4, C, 8) for b in batches)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 0
    drawn = np.concatenate([b.indices for b in batches])
    assert set(drawn.tolist()) == {0, 1} and len(drawn) == 400


def test_large_set_is_a_permutation_per_epoch(tmp_path):
    for i in range(5):
        _write(tmp_path, f"{i}.npy", 8)
    sampler = D.EpochSampler(5, batch_size=2, seed=1)
    assert sampler.batches_per_epoch == 3  # drop_last False: a short last batch
    loader = D.BatchLoader(D.PreEncodedDataset(tmp_path, 8), sampler)
    first = list(loader.epoch())
    second = list(loader.epoch())
    assert [len(b.indices) for b in first] == [2, 2, 1]
    assert sorted(np.concatenate([b.indices for b in first]).tolist()) == list(range(5))
    assert [b.epoch for b in second] == [1, 1, 1]
    assert D.EpochSampler(5, 2, 1, drop_last=True).batches_per_epoch == 2


def _signature(batch):
    return (batch.indices.tolist(), batch.latents.tobytes(), batch.padding_mask.tobytes(), batch.prompts)


def test_resume_from_sampler_state_gives_the_same_batches(tmp_path):
    for i in range(3):
        _write(tmp_path, f"{i}.npy", 30, valid=25, title=f"Song {i}", genre="dub, techno", bpm=120 + i)
    template = PromptTemplate(trigger="zxq", split_commas=True)

    def loader():
        return D.BatchLoader(
            D.PreEncodedDataset(tmp_path, 6, prompts=template), D.EpochSampler(3, batch_size=2, seed=7)
        )

    straight = loader()
    expected = [_signature(b) for _ in range(3) for b in straight.epoch()]

    first = loader()
    got = []
    for b in first.epoch():
        got.append(_signature(b))
        break  # stop after one batch, mid-epoch
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader()
    resumed.load_state_dict(state)
    while len(got) < len(expected):
        got += [_signature(b) for b in resumed.epoch()]
    assert got == expected
    assert any("zxq" in p for _, _, _, prompts in expected for p in prompts)
    with pytest.raises(ValueError, match="seed"):
        D.EpochSampler(3, 2, seed=8).load_state_dict(state)


def test_batch_fields(tmp_path):
    _write(tmp_path, "x.npy", 10, seconds=95.5, title="T")
    batch = next(D.BatchLoader(D.PreEncodedDataset(tmp_path, 10), D.EpochSampler(1, 1, 0)).epoch())
    assert batch.latents.dtype == np.float32 and batch.latents.shape == (1, C, 10)
    assert batch.padding_mask.shape == (1, 10) and batch.padding_mask.all()
    assert batch.seconds_total.tolist() == [95.5]
    assert batch.prompts == ["Title: T"] and batch.infos[0]["relpath"] == "x.npy"


def test_latents_are_memory_mapped(tmp_path, monkeypatch):
    _write(tmp_path, "m.npy", 20)
    ds = D.PreEncodedDataset(tmp_path, 8)
    mapped = []
    real_load = D.Span.load_npy
    monkeypatch.setattr(D.Span, "load_npy", lambda span, mmap=True: mapped.append(real_load(span, mmap)) or mapped[-1])
    ds.example(0, np.random.default_rng(0))
    assert len(mapped) == 1 and isinstance(mapped[0], np.memmap) and mapped[0].mode == "r"
