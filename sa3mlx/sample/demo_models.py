"""The models a demo render needs, loaded on first use and released afterwards.

* base demos with the renderer's adapter: the base DiT with that adapter applied **live**
  (`lora.inject`), its strength set per demo (torch strength semantics; DoRA/BoRA bypassed at 0);
  the trainer passes its own adapted model (`LiveModel`) instead of a file;
* base demos with another adapter set (multi-adapter entries): the adapters merged into a copy of
  the base weights (`lora.merge`, torch semantics, each at its own strength);
* ARC demos: the adapter set merged once into the ARC (`rf_denoiser`) weights, conditioner tensors
  included, with the -xs bases of the model they were trained against; an adapter that does not
  fit the ARC model is reported, not raised;
* the T5Gemma prompt encoder and the SAME decoder (fp32) of each model folder, one instance per
  distinct weight file.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.convert.checkpoint import CheckpointError, read_npz
from sa3mlx.lora.bases import read_bases
from sa3mlx.lora.checkpoint import read_lora
from sa3mlx.lora.inject import apply_checkpoint, set_strength
from sa3mlx.lora.layers import AdaptedLayer, LoRAShapeError
from sa3mlx.lora.maths import mlx_weight_to_2d
from sa3mlx.lora.merge import MergeInput, merge_arrays
from sa3mlx.lora.svd import svd_bases
from sa3mlx.lora.targeting import npz_weight_key
from sa3mlx.lora.types import adapter_kind
from sa3mlx.models.conditioning import Conditioner, build_dit, load_dit
from sa3mlx.models.config import ModelConfig
from sa3mlx.models.dit import DiT
from sa3mlx.models.prompt import PromptEncoder, weights_id
from sa3mlx.models.same import SameDecoder, SameEncoder, load_same_decoder, load_same_encoder
from sa3mlx.runtime.layout import DIT_FILE, MODEL_CONFIG_FILE, SAME_DECODER_FILE, SAME_ENCODER_FILE, T5GEMMA_FILE
from sa3mlx.sample.demo_entries import AdapterRef

ADAPTER_ERRORS = (LoRAShapeError, CheckpointError, KeyError, ValueError)


@dataclass
class LiveModel:
    """A DiT + Conditioner with adapters injected (e.g. the trainer's), by checkpoint layer name."""

    dit: DiT
    conditioner: Conditioner
    layers: dict[str, AdaptedLayer]
    prompts: PromptEncoder | None = None  # the owner's prompt encoder for the base model, if any

    def set_strength(self, strength: float, dit_only: bool = False) -> None:
        chosen = {n: layer for n, layer in self.layers.items() if not dit_only or n.startswith("model.")}
        set_strength(chosen, strength)


@dataclass
class Renderable:
    """What one demo samples with: a DiT + Conditioner, and its live adapters (None: merged/plain)."""

    dit: DiT
    conditioner: Conditioner
    live: LiveModel | None = None
    strength: float = 0.0  # for live adapters


class DemoModels:
    """Lazily loaded models for `render_demos`; `release()` drops everything but a given LiveModel."""

    def __init__(
        self,
        base_dir: str | Path,
        arc_dir: str | Path | None = None,
        *,
        svd_dir: str | Path | None = None,
        live: LiveModel | None = None,
        say: Callable[[str], None] = print,
    ):
        self.base_dir, self.arc_dir = Path(base_dir), Path(arc_dir) if arc_dir else None
        self.svd_dir = Path(svd_dir) if svd_dir else None
        self.base_config = ModelConfig.load(self.base_dir / MODEL_CONFIG_FILE)
        self.arc_config = ModelConfig.load(self.arc_dir / MODEL_CONFIG_FILE) if self.arc_dir else None
        self.say = say
        self._given_live = live
        self.release()

    def release(self) -> None:
        """Drop every model this session loaded (a LiveModel passed in stays with its owner)."""
        self._live, self._live_key = self._given_live, None
        self._plain: dict[str, tuple[DiT, Conditioner]] = {}
        self._merged: dict[tuple, tuple[DiT, Conditioner] | str] = {}
        self._arrays: dict[str, dict[str, np.ndarray]] = {}
        self._prompts: dict[str, PromptEncoder] = {}
        self._decoders: dict[tuple[str, bool], SameDecoder] = {}
        self._encoders: dict[str, SameEncoder] = {}
        self._bases = None
        gc.collect()
        mx.clear_cache()

    def config(self, arc: bool) -> ModelConfig:
        if arc and self.arc_config is None:
            raise ValueError("an ARC demo needs the ARC model (model.arc)")
        return self.arc_config if arc else self.base_config

    def folder(self, arc: bool) -> Path:
        return self.arc_dir if arc else self.base_dir

    # -- pieces shared by every demo ---------------------------------------------------------------
    def prompt_encoder(self, arc: bool) -> PromptEncoder:
        """The folder's T5Gemma encoder; one instance per distinct weight file."""
        if not arc and self._given_live is not None and self._given_live.prompts is not None:
            return self._given_live.prompts
        folder = self.folder(arc)
        key = weights_id(folder / T5GEMMA_FILE)
        if key not in self._prompts:
            self._prompts[key] = PromptEncoder.from_converted(folder)
        return self._prompts[key]

    def decoder(self, arc: bool = False, official_noise: bool = False) -> SameDecoder:
        """The folder's SAME decoder (fp32); one instance per distinct weight file. With
        `official_noise` it draws the eval-mode noise the official decode draws (bottleneck
        noise_regularize, decoder mask_noise, as the model config sets them)."""
        path = self.folder(arc) / SAME_DECODER_FILE
        key = (weights_id(path), official_noise)
        if key not in self._decoders:
            codec = self.config(arc).autoencoder
            noise = {"mask_noise": codec.decoder.mask_noise, "noise_regularize": codec.noise_regularize}
            self._decoders[key] = load_same_decoder(path, **(noise if official_noise else {}))
        return self._decoders[key]

    def encoder(self, arc: bool = False) -> SameEncoder:
        """The folder's SAME encoder (fp32; its mask_noise, 0 in SA3, as the config sets it)."""
        path = self.folder(arc) / SAME_ENCODER_FILE
        key = weights_id(path)
        if key not in self._encoders:
            noise = self.config(arc).autoencoder.encoder.mask_noise
            self._encoders[key] = load_same_encoder(path, mask_noise=noise)
        return self._encoders[key]

    # -- DiTs ---------------------------------------------------------------------------------------
    def renderable(
        self, arc: bool, adapters: tuple[AdapterRef, ...], default: tuple[AdapterRef, ...], baseline: bool
    ) -> Renderable | str:
        """The model one demo renders with, or a message saying why it cannot be rendered."""
        if arc and self.arc_dir is None:
            return "no ARC model was given (model.arc)"
        if arc:
            if baseline or not adapters:
                return Renderable(*self._plain_dit(True))
            merged = self._merged_dit(True, adapters)
            return merged if isinstance(merged, str) else Renderable(*merged)
        live = self._live_for(default)
        if baseline or not adapters:
            live = live or self._live  # any live adapter at strength 0 is the plain model
            return Renderable(live.dit, live.conditioner, live, 0.0) if live else Renderable(*self._plain_dit(False))
        if live is not None and len(adapters) == 1 and len(default) == 1 and adapters[0].path == default[0].path:
            return Renderable(live.dit, live.conditioner, live, adapters[0].strength)
        merged = self._merged_dit(False, adapters)
        return merged if isinstance(merged, str) else Renderable(*merged)

    def plain(self, arc: bool) -> Renderable:
        """The model without adapters (live adapters at strength 0 where the base has them)."""
        return self.renderable(arc, (), (), True)

    def _live_for(self, default: tuple[AdapterRef, ...]) -> LiveModel | None:
        """The base model with the single default adapter applied live (injected once)."""
        if self._given_live is not None:
            return self._given_live
        if len(default) != 1:
            return None
        key = str(default[0].path)
        if self._live is None:
            dit, cond = load_dit(self.base_dir / DIT_FILE)
            xs = adapter_kind(read_lora(default[0].path).config["adapter_type"]).xs
            layers = apply_checkpoint(
                dit,
                cond,
                default[0].path,
                default[0].strength,
                svd_bases=self.svd_bases() if xs else None,
                announce=False,
            )
            self._live, self._live_key = LiveModel(dit, cond, layers), key
        if self._live_key != key:
            return None
        return self._live

    def _plain_dit(self, arc: bool) -> tuple[DiT, Conditioner]:
        name = "arc" if arc else "base"
        if name not in self._plain:
            self._plain[name] = load_dit(self.folder(arc) / DIT_FILE)
        return self._plain[name]

    def _base_arrays(self, arc: bool) -> dict[str, np.ndarray]:
        name = "arc" if arc else "base"
        if name not in self._arrays:
            self._arrays[name] = read_npz(self.folder(arc) / DIT_FILE)
        return self._arrays[name]

    def svd_bases(self) -> dict | None:
        """The -xs bases of the base model (the svd stage's file), when one was given."""
        if self._bases is None and self.svd_dir is not None and (self.svd_dir.is_file() or self.svd_dir.is_dir()):
            try:
                self._bases = read_bases(self.svd_dir)
            except CheckpointError:
                self._bases = {}
        return self._bases or None

    def _xs_bases(self, inputs: list[MergeInput]) -> dict | None:
        """Bases for -xs adapters: the svd file, else computed from the *base* weights (what
        training decomposed), never from the model merged into."""
        if not any(adapter_kind(i.adapter.lora_config.adapter_type).xs for i in inputs):
            return None
        bases = dict(self.svd_bases() or {})
        base = self._base_arrays(False)
        for item in inputs:
            for name in item.adapter.layers:
                if name not in bases:
                    weight = mlx_weight_to_2d(base[npz_weight_key(name)].astype(np.float32))
                    bases[name] = svd_bases(weight, item.adapter.lora_config.rank)
        return bases

    def _merged_dit(self, arc: bool, adapters: tuple[AdapterRef, ...]) -> tuple[DiT, Conditioner] | str:
        key = (arc, tuple((str(a.path), a.strength) for a in adapters))
        if key not in self._merged:
            self._merged[key] = self._merge(arc, adapters)
        return self._merged[key]

    def _merge(self, arc: bool, adapters: tuple[AdapterRef, ...]) -> tuple[DiT, Conditioner] | str:
        target = "ARC model " + self.arc_dir.name if arc else "base model " + self.base_dir.name
        try:
            inputs = [MergeInput(read_lora(a.path), a.strength) for a in adapters]
            merged = merge_arrays(self._base_arrays(arc), inputs, svd=self._xs_bases(inputs), say=self.say)
            config = self.config(arc)
            return build_dit(merged, config.dit, Conditioner.from_config(config.conditioner))
        except ADAPTER_ERRORS as e:
            names = ", ".join(a.path.name for a in adapters)
            return f"{names} does not fit the {target}: {e}"
