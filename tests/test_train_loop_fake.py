"""A small stand-in for `TrainingSession` (real adapters, real AdamW and schedules, a toy loss) and
a tiny latent folder, so the loop's saving, resuming and guards are tested in milliseconds."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from sa3mlx.data.dataset import BatchLoader, EpochSampler, PreEncodedDataset
from sa3mlx.lora.checkpoint import lora_key
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.layers import build_adapters
from sa3mlx.train import optim as O
from sa3mlx.train.session import StepOutput

CHANNELS, CROP = 8, 6
LAYER_NAMES = ("model.transformer.layers.0.self_attn.to_qkv", "model.transformer.layers.0.ff.ff.0.proj")


class _Net(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class FakeSession:
    """The TrainingSession interface over two dora-rows layers regressing a fixed map."""

    def __init__(self, seed=0, lr=1e-2, schedule="inverse", nan_steps=(), max_minutes=None, on_step=None):
        bases = {}
        for i, name in enumerate(LAYER_NAMES):
            linear = nn.Linear(CHANNELS, CHANNELS)
            weights = np.random.default_rng(i).standard_normal((CHANNELS + 1, CHANNELS)).astype(np.float32)
            linear.update({"weight": mx.array(weights[:-1]) * 0.3, "bias": mx.array(weights[-1]) * 0.1})
            bases[name] = linear
        self.adapters = build_adapters(bases, "dora-rows", 2, seed=seed)
        self.lora_config = LoRAConfig(rank=2)
        self.net = _Net(list(self.adapters.values()))
        self.optimizer = O.make_adamw(O.AdamWConfig(lr=lr, betas=(0.9, 0.95)))
        options = {"inv_gamma": 10.0, "power": 0.5, "warmup": 0.9} if schedule == "inverse" else {}
        if schedule == "wsd":
            options = {"max_minutes": max_minutes}
        self.schedule = O.make_schedule(schedule, lr, options)
        self.k = 0
        self.nan_steps, self.on_step, self.calls = set(nan_steps), on_step, 0
        self.target = mx.array(np.random.default_rng(99).standard_normal((CHANNELS, CHANNELS)), mx.float32)
        self.optimizer.init(self.net.trainable_parameters())

    def _loss(self, x, y):
        return mx.mean(mx.square(self.net(x) - y))

    def step(self, batch, rng):
        self.calls += 1
        x = np.transpose(batch["latents"], (0, 2, 1)).reshape(-1, CHANNELS)
        x = mx.array(x + 0.1 * rng.standard_normal(x.shape).astype(np.float32))
        y = x @ self.target
        loss, grads = nn.value_and_grad(self.net, self._loss)(x, y)
        if self.calls in self.nan_steps:
            loss = loss * float("nan")
        lr = self.schedule.lr(self.k)
        finite = bool(np.isfinite(loss.item()))
        grads, norm = O.clip_grad_norm(grads, 1.0)
        if finite:
            self.optimizer.learning_rate = mx.array(lr, mx.float32)
            self.optimizer.update(self.net, grads)
            self.k += 1
        mx.eval(self.net.parameters(), self.optimizer.state)
        magnitude = O.global_norm(self.net.trainable_parameters())
        if self.on_step:
            self.on_step(self)
        return StepOutput(
            loss=loss.item(),
            grad_norm=norm.item(),
            lora_magnitude=magnitude.item(),
            t_mean=float(rng.uniform()),
            lr=lr,
            finite=finite,
        )

    @property
    def next_lr(self):
        return self.schedule.lr(self.k)

    def prompt_cache_stats(self):
        return {"hits": 0, "misses": 0, "hit_rate": 0.5}

    def state_dict(self):
        return {
            "optimizer": O.optimizer_state_dict(self.optimizer),
            "schedule": self.schedule.state_dict(),
            "k": self.k,
        }

    def load_state_dict(self, state):
        O.load_optimizer_state(self.optimizer, state["optimizer"], self.net.trainable_parameters())
        self.schedule.load_state_dict(state["schedule"])
        self.k = int(state["k"])

    def adapter_state(self):
        return {
            lora_key(name, param): np.array(value)
            for name, layer in self.adapters.items()
            for param, value in layer.lora_state().items()
        }

    def load_adapter_state(self, state):
        for name, layer in self.adapters.items():
            layer.load_lora_state({p: state[lora_key(name, p)] for p in layer.lora_state()}, name)


def write_latents(root, count=5, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        length = int(rng.integers(4, 14))
        np.save(root / f"clip{i}.npy", rng.standard_normal((CHANNELS, length)).astype(np.float32))
        (root / f"clip{i}.json").write_text(
            json.dumps({"seconds_total": length * 0.09, "padding_mask": [1] * length, "prompt": f"clip number {i}"})
        )
    return root


def make_loader(root, batch_size=2, seed=7):
    dataset = PreEncodedDataset(root, CROP, random_crop=True)
    return BatchLoader(dataset, EpochSampler(len(dataset), batch_size, seed))


def test_fake_session_learns(tmp_path):
    loader = make_loader(write_latents(tmp_path / "latents"))
    session = FakeSession(lr=5e-2, schedule="none")
    losses = [
        session.step({"latents": b.latents}, np.random.default_rng(i)).loss for i, b in zip(range(30), _cycle(loader))
    ]
    assert losses[-1] < 0.5 * losses[0]
    assert all(np.isfinite(v).all() for _, v in tree_flatten(session.net.trainable_parameters()))


def _cycle(loader):
    while True:
        yield from loader.epoch()


# ---- a tiny real project (converted tiny-base + synthetic latents) for the real TrainingSession ----

TINY_PARAMS = {
    "preset": "underfit-dashboard",
    "name": "tiny-lora",
    "max_steps": 8,
    "checkpoint_every": 4,
    "keep_last": None,
    "lr": 1e-3,
    "batch_size": 2,
    "latent_crop_length": 16,
    "seed": 5,
    "adapter": {"adapter_type": "dora-rows", "rank": 4},
}


def reproducible_prompt_encoding():
    """Encode prompt-cache misses one prompt per call, so an embedding never depends on which
    other prompts shared its encoder batch (BLAS results change with the batch size) and a fresh
    cache after a resume gives the same bits. Reported for sa3mlx/models/prompt.py; a no-op
    once it encodes that way itself. Returns a function that restores the previous setting."""
    import sa3mlx.models.prompt as prompt

    previous, prompt.ENCODE_BATCH = prompt.ENCODE_BATCH, 1
    return lambda: setattr(prompt, "ENCODE_BATCH", previous)


def make_tiny_project(root):
    """models/converted/tiny-base (from the embedded tiny model) + data/latents (6 synthetic clips)."""
    from conftest import ROOT

    from sa3mlx.convert.model import convert_source
    from sa3mlx.models.config import ModelConfig

    convert_source(ROOT / "models" / "tiny-base", root / "models" / "converted" / "tiny-base")
    channels = ModelConfig.load(root / "models" / "converted" / "tiny-base" / "model_config.json").dit.io_channels
    rng = np.random.default_rng(1)
    latents = root / "data" / "latents"
    latents.mkdir(parents=True)
    tags = ["house drums", "ambient pad", "bass line", "piano chords", "synth lead", "techno loop"]
    for i, tag in enumerate(tags):
        length = int(rng.integers(12, 40))
        np.save(latents / f"clip{i}.npy", rng.standard_normal((channels, length)).astype(np.float32))
        (latents / f"clip{i}.json").write_text(
            json.dumps(
                {
                    "seconds_total": round(length * 4096 / 44100, 3),
                    "padding_mask": [1] * length,
                    "prompt": tag,
                    "genre": "test",
                }
            )
        )
    return root
