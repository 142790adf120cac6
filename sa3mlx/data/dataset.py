"""The pre-encoded dataset: latent npy + json sidecar pairs, cropped or padded to a fixed length.

Semantics of SA3's `PreEncodedDataset` as underfit builds it: every `*.npy` under the root
except `silence.npy` (or the files listed in `filelist.txt`), each with its same-name `.json`.
A clip longer than the crop is cut at `randint(0, last_valid − crop)` (inclusive; last_valid =
index of the last 1 of its padding mask) when random cropping and last_valid > crop, else at 0;
a shorter one is padded with `silence.npy` (sliced or tiled) if the root has one, else zeros,
its mask extended with zeros. `seconds_total` stays the full file's duration.

Reads are memory-mapped; every random choice is a pure function of (seed, epoch, draw), so the
sampler position alone (`EpochSampler.state_dict()`) resumes the exact batch sequence: the same
order, crops and prompts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sa3mlx.data.prompts import PromptTemplate, build_prompt

SILENCE_FILE = "silence.npy"
FILELIST = "filelist.txt"
OVERSAMPLE_BATCHES = 100  # a set smaller than a batch is drawn with replacement: batch·100 per epoch
_ORDER, _CROP, _PROMPT = 0, 1, 2  # independent random streams of one (seed, epoch)


@dataclass(frozen=True)
class LatentFile:
    latent: Path
    sidecar: Path
    relpath: str  # the .npy path relative to the root, "/"-separated


def find_latents(root: str | Path) -> list[LatentFile]:
    """The latent/sidecar pairs under root, sorted by relpath (`filelist.txt` order if present)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: latent folder not found")
    listed = root / FILELIST
    if listed.is_file():
        paths = [root / line.strip() for line in listed.read_text().splitlines() if line.strip()]
    else:
        paths = sorted(root.rglob("*.npy"), key=lambda p: p.relative_to(root).as_posix())
    files, orphans = [], []
    for path in paths:
        if path.name == SILENCE_FILE:
            continue
        sidecar = path.with_suffix(".json")
        if not sidecar.is_file():
            orphans.append(path.relative_to(root).as_posix())
            continue
        files.append(LatentFile(path, sidecar, path.relative_to(root).as_posix()))
    if orphans:
        raise FileNotFoundError(
            f"{root}: latents without a .json sidecar: {orphans[:5]}{' …' if len(orphans) > 5 else ''}"
        )
    if not files:
        raise ValueError(f"{root}: no pre-encoded latents (*.npy with .json sidecars)")
    return files


def load_silence(root: str | Path) -> np.ndarray | None:
    """`<root>/silence.npy` as [C, N] fp32 (a leading batch axis is dropped), or None."""
    path = Path(root) / SILENCE_FILE
    if not path.is_file():
        return None
    silence = np.load(path)
    while silence.ndim > 2 and silence.shape[0] == 1:
        silence = silence[0]
    if silence.ndim != 2 or silence.shape[1] == 0:
        raise ValueError(f"{path}: expected a [C, N] latent, got shape {silence.shape}")
    return silence.astype(np.float32)


@dataclass
class Example:
    latents: np.ndarray  # [C, crop] fp32
    padding_mask: np.ndarray  # [crop] bool, True = real audio
    info: dict  # the sidecar (tags, seconds_total, ...) + latent_crop_start/_length; no padding_mask


def last_valid_index(mask: np.ndarray) -> int | None:
    valid = np.flatnonzero(mask)
    return int(valid[-1]) if valid.size else None


def crop_start(mask: np.ndarray, crop: int, random_crop: bool, rng: np.random.Generator) -> int:
    last = last_valid_index(mask)
    if random_crop and last is not None and last > crop:
        return int(rng.integers(0, last - crop, endpoint=True))
    return 0


def pad_latents(latents: np.ndarray, length: int, silence: np.ndarray | None) -> np.ndarray:
    need = length - latents.shape[1]
    if silence is None:
        filler = np.zeros((latents.shape[0], need), np.float32)
    else:
        if silence.shape[0] != latents.shape[0]:
            raise ValueError(f"silence.npy has {silence.shape[0]} channels, latents {latents.shape[0]}")
        filler = np.tile(silence, (1, math.ceil(need / silence.shape[1])))[:, :need]
    return np.concatenate([latents, filler], axis=1)


def _fit_mask(mask: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros(length, bool)
    out[: min(length, mask.size)] = mask[:length]
    return out


class PreEncodedDataset:
    def __init__(
        self,
        root: str | Path,
        crop_length: int | None,
        random_crop: bool = True,
        prompts: PromptTemplate | None = None,
        files: list[LatentFile] | None = None,
    ):
        """`files`: these pairs of `root` only (e.g. a train / validation split); None: every pair."""
        self.root = Path(root)
        self.files = find_latents(self.root) if files is None else list(files)
        self.silence = load_silence(self.root)
        self.crop_length = crop_length
        self.random_crop = random_crop
        self.prompts = prompts

    def __len__(self) -> int:
        return len(self.files)

    def sidecar(self, index: int) -> dict:
        entry = self.files[index]
        try:
            info = json.loads(entry.sidecar.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{entry.sidecar}: unreadable sidecar ({e})") from None
        if "seconds_total" not in info:
            raise ValueError(f"{entry.sidecar}: no seconds_total")
        return info

    def example(self, index: int, rng: np.random.Generator) -> Example:
        entry = self.files[index]
        info = self.sidecar(index)
        stored = np.load(entry.latent, mmap_mode="r")
        if stored.ndim == 3 and stored.shape[0] == 1:
            stored = stored[0]
        if stored.ndim != 2:
            raise ValueError(f"{entry.latent}: expected [C, T] latents, got shape {stored.shape}")
        length = stored.shape[1]
        mask = np.asarray(info.pop("padding_mask", np.ones(length)), dtype=np.int64).astype(bool)
        crop = length if self.crop_length is None else int(self.crop_length)
        start = 0
        if length > crop:
            start = crop_start(mask, crop, self.random_crop, rng)
            latents = np.array(stored[:, start : start + crop], np.float32)
            mask = _fit_mask(mask[start : start + crop], crop)
        elif length < crop:
            latents = pad_latents(np.array(stored, np.float32), crop, self.silence)
            mask = _fit_mask(mask[:length], crop)
        else:
            latents = np.array(stored, np.float32)
            mask = _fit_mask(mask, crop)
        info.update(latent_filename=str(entry.latent), latent_crop_start=start, latent_crop_length=crop)
        info.setdefault("relpath", entry.relpath)
        return Example(latents, mask, info)


@dataclass
class Batch:
    latents: np.ndarray  # [B, C, T] fp32
    padding_mask: np.ndarray  # [B, T] bool
    seconds_total: np.ndarray  # [B] float64, full-file durations
    prompts: list[str]
    infos: list[dict]
    indices: np.ndarray  # [B] dataset indices
    epoch: int = 0
    position: int = 0  # batch index within the epoch


class EpochSampler:
    """Which dataset items each batch holds, epoch by epoch, seeded and resumable.

    Sets at least a batch large: a permutation per epoch (or in order when not shuffling).
    Smaller sets: batch·100 draws with replacement per epoch. The last batch of an epoch may
    be short unless `drop_last`. State = (epoch, position); the random draws of a batch are
    derived from (seed, epoch, draw index), so no generator state needs saving.
    """

    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = False):
        if size < 1 or batch_size < 1:
            raise ValueError(f"sampler needs items and a batch size, got size={size}, batch_size={batch_size}")
        self.size, self.batch_size, self.seed = size, batch_size, int(seed)
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def oversampled(self) -> bool:
        return self.size < self.batch_size

    @property
    def samples_per_epoch(self) -> int:
        return self.batch_size * OVERSAMPLE_BATCHES if self.oversampled else self.size

    @property
    def batches_per_epoch(self) -> int:
        whole, rest = divmod(self.samples_per_epoch, self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def rng(self, stream: int, epoch: int, draw: int | None = None) -> np.random.Generator:
        key = [self.seed, stream, epoch] + ([] if draw is None else [draw])
        return np.random.default_rng(key)

    def order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = self.rng(_ORDER, epoch)
            if self.oversampled:
                order = rng.integers(0, self.size, self.samples_per_epoch)
            elif self.shuffle:
                order = rng.permutation(self.size)
            else:
                order = np.arange(self.size)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def draws(self, epoch: int, position: int) -> range:
        start = position * self.batch_size
        return range(start, min(start + self.batch_size, self.samples_per_epoch))

    def crop_rng(self, epoch: int, draw: int) -> np.random.Generator:
        return self.rng(_CROP, epoch, draw)

    def prompt_rng(self, epoch: int, draw: int) -> random.Random:
        return random.Random(int(self.rng(_PROMPT, epoch, draw).integers(0, 2**63)))

    def remaining(self) -> Iterator[tuple[int, int, range]]:
        """(epoch, position, draws) for the rest of the current epoch; the position advances as each
        is yielded, and after the last one the sampler stands at the start of the next epoch.
        A batch counts as consumed once yielded: pull one only when it will be trained on."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        epoch = self.epoch
        while self.epoch == epoch and self.position < self.batches_per_epoch:
            position = self.position
            self.position += 1
            if self.position == self.batches_per_epoch:
                self.epoch, self.position = epoch + 1, 0
            yield epoch, position, self.draws(epoch, position)

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "size": self.size,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        differ = [k for k in ("seed", "size", "batch_size", "shuffle", "drop_last") if state.get(k) != mine[k]]
        if differ:
            raise ValueError(f"sampler state is for another dataset/sampler ({', '.join(differ)} differ)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class BatchLoader:
    """Batches of a dataset in its sampler's order; `epoch()` yields the rest of the current epoch."""

    def __init__(
        self,
        dataset: PreEncodedDataset,
        sampler: EpochSampler,
        prompt_fn: Callable[[dict, random.Random], str] | None = None,
    ):
        if sampler.size != len(dataset):
            raise ValueError(f"sampler is for {sampler.size} items, dataset has {len(dataset)}")
        self.dataset, self.sampler = dataset, sampler
        self.prompt_fn = prompt_fn or (lambda info, rng: build_prompt(info, dataset.prompts, rng))

    def batch(self, epoch: int, position: int, draws: range) -> Batch:
        order = self.sampler.order(epoch)
        indices = np.asarray([order[d] for d in draws], np.int64)
        examples = [self.dataset.example(int(i), self.sampler.crop_rng(epoch, d)) for i, d in zip(indices, draws)]
        prompts = [self.prompt_fn(ex.info, self.sampler.prompt_rng(epoch, d)) for ex, d in zip(examples, draws)]
        return Batch(
            latents=np.stack([ex.latents for ex in examples]),
            padding_mask=np.stack([ex.padding_mask for ex in examples]),
            seconds_total=np.asarray([float(ex.info["seconds_total"]) for ex in examples], np.float64),
            prompts=prompts,
            infos=[ex.info for ex in examples],
            indices=indices,
            epoch=epoch,
            position=position,
        )

    def epoch(self) -> Iterator[Batch]:
        for epoch, position, draws in self.sampler.remaining():
            yield self.batch(epoch, position, draws)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
