"""Model configs, parsed in one place from the official `model_config.json` format.

One frozen dataclass per concept: the DiT, a SAME codec half, the autoencoder,
the conditioner, the T5Gemma text encoder and the whole SA3 model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sa3mlx.runtime.layout import MODEL_CONFIG_FILE

# Real SA3 DiT sizes (embed_dim, depth) -> family name.
DIT_FAMILIES = {(1024, 20): "small", (1536, 24): "medium"}
OBJECTIVES = ("rectified_flow", "rf_denoiser")


class ConfigError(ValueError):
    """A model config is missing a field or disagrees with the weights."""


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise ConfigError(f"{where}: missing '{key}'")
    return d[key]


@dataclass(frozen=True)
class DiTConfig:
    io_channels: int
    embed_dim: int
    depth: int
    num_heads: int
    cond_token_dim: int
    global_cond_dim: int
    local_add_cond_dim: int
    num_memory_tokens: int
    timestep_features_dim: int
    ff_inner: int
    differential: bool

    @property
    def dim_head(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def rope_dim(self) -> int:
        return max(self.dim_head // 2, 32)

    @classmethod
    def from_dict(cls, d: dict, where: str = "diffusion.config") -> DiTConfig:
        embed_dim = _need(d, "embed_dim", where)
        mult = d.get("ff_kwargs", {}).get("mult", 4)
        return cls(
            io_channels=_need(d, "io_channels", where),
            embed_dim=embed_dim,
            depth=_need(d, "depth", where),
            num_heads=_need(d, "num_heads", where),
            cond_token_dim=d.get("cond_token_dim", 768),
            global_cond_dim=d.get("global_cond_dim", 768),
            local_add_cond_dim=d.get("local_add_cond_dim", 0),
            num_memory_tokens=d.get("num_memory_tokens", 0),
            timestep_features_dim=d.get("timestep_features_dim", 256),
            ff_inner=int(embed_dim * mult),
            differential=bool(d.get("attn_kwargs", {}).get("differential", False)),
        )


@dataclass(frozen=True)
class SameConfig:
    """One half (encoder or decoder) of a SAME codec; exactly one resampling block."""

    io_channels: int  # encoder in_channels / decoder out_channels (= audio channels x patch)
    width: int  # D = channels * c_mults[0]
    latent_dim: int
    stride: int
    depth: int
    dim_heads: int
    ff_inner: int
    differential: bool
    chunk_size: int
    chunk_midpoint_shift: bool
    sliding_window: tuple[int, int] | None
    conv_mapping: bool
    sinusoidal_blocks: int
    mask_noise: float

    @property
    def mapping_kernel(self) -> int:
        return 3 if self.conv_mapping else 1

    @classmethod
    def from_dict(cls, d: dict, role: str, where: str) -> SameConfig:
        c = _need(d, "config", where)
        strides, mults = _need(c, "strides", where), _need(c, "c_mults", where)
        if len(strides) != 1 or len(mults) != 1:
            raise ConfigError(
                f"{where}: only single-stage SAME codecs (one stride) are supported, got strides {strides}"
            )
        width = _need(c, "channels", where) * mults[0]
        window = c.get("sliding_window")
        sinusoidal = c.get("sinusoidal_blocks", [0])
        return cls(
            io_channels=_need(c, "in_channels" if role == "encoder" else "out_channels", where),
            width=width,
            latent_dim=_need(c, "latent_dim", where),
            stride=strides[0],
            depth=_need(c, "transformer_depths", where)[0],
            dim_heads=c.get("dim_heads", 64),
            ff_inner=int(width * c.get("ff_mult", 3)),
            differential=bool(c.get("differential", True)),
            chunk_size=c.get("chunk_size", 32),
            chunk_midpoint_shift=bool(c.get("chunk_midpoint_shift", False)),
            sliding_window=tuple(window) if window else None,
            conv_mapping=bool(c.get("conv_mapping", False)),
            sinusoidal_blocks=int(sinusoidal[0] if isinstance(sinusoidal, list) else sinusoidal),
            mask_noise=float(c.get("mask_noise", 0.0)),
        )


@dataclass(frozen=True)
class AutoencoderConfig:
    encoder: SameConfig
    decoder: SameConfig
    latent_dim: int
    patch_size: int
    audio_channels: int
    downsampling_ratio: int
    noise_augment_dim: int
    noise_regularize: bool

    @classmethod
    def from_dict(cls, d: dict, where: str = "pretransform.config") -> AutoencoderConfig:
        for part in ("encoder", "decoder"):
            if _need(d, part, where).get("type") != "same":
                raise ConfigError(f"{where}.{part}: only SAME codecs are supported")
        patch = _need(d, "pretransform", where).get("config", {})
        bottleneck = _need(d, "bottleneck", where).get("config", {})
        return cls(
            encoder=SameConfig.from_dict(d["encoder"], "encoder", f"{where}.encoder"),
            decoder=SameConfig.from_dict(d["decoder"], "decoder", f"{where}.decoder"),
            latent_dim=_need(d, "latent_dim", where),
            patch_size=patch.get("patch_size", 256),
            audio_channels=patch.get("channels", 2),
            downsampling_ratio=_need(d, "downsampling_ratio", where),
            noise_augment_dim=bottleneck.get("noise_augment_dim", 0),
            noise_regularize=bool(bottleneck.get("noise_regularize", False)),
        )

    @classmethod
    def from_standalone(cls, d: dict) -> AutoencoderConfig:
        """An AE-only config (`model_type: autoencoder`, e.g. stabilityai/SAME-S)."""
        return cls.from_dict(_need(d, "model", "model_config"), "model")


@dataclass(frozen=True)
class PromptConfig:
    max_length: int
    padding_mode: str
    encoder_path: str  # folder of the T5Gemma encoder, relative to the model folder

    @classmethod
    def from_dict(cls, c: dict) -> PromptConfig:
        path = c.get("model_path") or c.get("subfolder") or "t5gemma-b-b-ul2"
        return cls(
            max_length=c.get("max_length", 256), padding_mode=c.get("padding_mode", "learned"), encoder_path=path
        )


@dataclass(frozen=True)
class SecondsConfig:
    min_val: float
    max_val: float


@dataclass(frozen=True)
class ConditionerConfig:
    cond_dim: int
    prompt: PromptConfig
    seconds: SecondsConfig

    @classmethod
    def from_dict(cls, d: dict, where: str = "conditioning") -> ConditionerConfig:
        by_id = {c["id"]: c for c in _need(d, "configs", where)}
        for cid in ("prompt", "seconds_total"):
            if cid not in by_id:
                raise ConfigError(f"{where}: no '{cid}' conditioner")
        sec = by_id["seconds_total"].get("config", {})
        return cls(
            cond_dim=_need(d, "cond_dim", where),
            prompt=PromptConfig.from_dict(by_id["prompt"].get("config", {})),
            seconds=SecondsConfig(float(sec.get("min_val", 0)), float(sec.get("max_val", 384))),
        )


@dataclass(frozen=True)
class T5GemmaConfig:
    """The encoder half of an HF T5GemmaConfig (`config.json`)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]
    sliding_window: int
    pad_token_id: int

    @classmethod
    def from_hf(cls, d: dict, where: str = "config.json") -> T5GemmaConfig:
        enc = d.get("encoder", d)
        rope = enc.get("rope_parameters") or {}
        layers = _need(enc, "num_hidden_layers", where)
        return cls(
            vocab_size=_need(enc, "vocab_size", where),
            hidden_size=_need(enc, "hidden_size", where),
            num_layers=layers,
            num_heads=_need(enc, "num_attention_heads", where),
            num_kv_heads=enc.get("num_key_value_heads", enc["num_attention_heads"]),
            head_dim=enc.get("head_dim", enc["hidden_size"] // enc["num_attention_heads"]),
            intermediate_size=_need(enc, "intermediate_size", where),
            query_pre_attn_scalar=float(enc.get("query_pre_attn_scalar", enc.get("head_dim", 64))),
            attn_logit_softcapping=enc.get("attn_logit_softcapping"),
            rms_norm_eps=float(enc.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", enc.get("rope_theta", 10000.0))),
            layer_types=tuple(enc.get("layer_types") or ["full_attention"] * layers),
            sliding_window=int(enc.get("sliding_window") or 4096),
            pad_token_id=int(enc.get("pad_token_id", d.get("pad_token_id", 0))),
        )

    @classmethod
    def load(cls, folder: str | Path) -> T5GemmaConfig:
        path = Path(folder) / "config.json"
        return cls.from_hf(json.loads(path.read_text()), str(path))


@dataclass(frozen=True)
class ModelConfig:
    """A whole SA3 model (`model_type: diffusion_cond_inpaint`)."""

    sample_rate: int
    sample_size: int
    audio_channels: int
    objective: str
    dit: DiTConfig
    autoencoder: AutoencoderConfig
    conditioner: ConditionerConfig
    repo_id: str | None
    distribution_shift: dict | None = None  # training shift options ({"type": "full", ...})
    sampling_distribution_shift: dict | None = None  # inference shift options (None: LogSNR rate 0)
    use_effective_length: bool = False  # shift length from the full seconds_total, not the crop
    mask_padding_attention: bool = False

    @property
    def variant(self) -> str:
        """small-music, small-sfx, medium (each with -base for rectified_flow) or tiny."""
        family = DIT_FAMILIES.get((self.dit.embed_dim, self.dit.depth), "tiny")
        if family == "small":
            repo = self.repo_id or ""
            family += "-sfx" if "sfx" in repo else "-music" if "music" in repo else ""
        return family + ("-base" if self.objective == "rectified_flow" else "")

    @classmethod
    def from_dict(cls, d: dict, where: str = MODEL_CONFIG_FILE) -> ModelConfig:
        if d.get("model_type") not in ("diffusion_cond", "diffusion_cond_inpaint"):
            raise ConfigError(f"{where}: model_type '{d.get('model_type')}' is not an SA3 diffusion model")
        model = _need(d, "model", where)
        diffusion = _need(model, "diffusion", f"{where}: model")
        objective = diffusion.get("diffusion_objective", "rectified_flow")
        if objective not in OBJECTIVES:
            raise ConfigError(f"{where}: unsupported diffusion_objective '{objective}'")
        if diffusion.get("type") != "dit":
            raise ConfigError(f"{where}: diffusion type '{diffusion.get('type')}' is not 'dit'")
        conditioning = _need(model, "conditioning", f"{where}: model")
        prompt = next((c for c in conditioning.get("configs", []) if c.get("id") == "prompt"), {})
        return cls(
            sample_rate=d.get("sample_rate", 44100),
            sample_size=d.get("sample_size", 0),
            audio_channels=d.get("audio_channels", 2),
            objective=objective,
            dit=DiTConfig.from_dict(_need(diffusion, "config", f"{where}: diffusion")),
            autoencoder=AutoencoderConfig.from_dict(
                _need(_need(model, "pretransform", f"{where}: model"), "config", f"{where}: pretransform")
            ),
            conditioner=ConditionerConfig.from_dict(conditioning),
            repo_id=prompt.get("config", {}).get("repo_id"),
            distribution_shift=diffusion.get("distribution_shift_options"),
            sampling_distribution_shift=diffusion.get("sampling_distribution_shift_options"),
            use_effective_length=bool(diffusion.get("use_effective_length_for_schedule", False)),
            mask_padding_attention=bool(diffusion.get("mask_padding_attention", False)),
        )

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, str(path))
