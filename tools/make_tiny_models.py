"""Build the two tiny embedded default models shipped in ``models/``.

``models/tiny-base`` mirrors the layout of the Hugging Face repo
``stabilityai/stable-audio-3-small-music-base`` (rectified-flow objective) and
``models/tiny-arc`` mirrors ``stabilityai/stable-audio-3-small-music``
(``rf_denoiser`` objective). Each folder holds

* ``model_config.json`` -- official-format SA3 config (``diffusion_cond_inpaint``)
  with a tiny DiT and a tiny SAME-S-like codec (still 4096 samples per latent);
* ``model.safetensors`` -- the official state-dict key layout
  (``model.model.*`` DiT, ``conditioner.conditioners.*``, ``pretransform.model.*``);
* ``t5gemma-b-b-ul2/`` -- a tiny HF T5Gemma encoder folder (config, encoder-only
  weights, a WordLevel tokenizer over ``tools/demo_vocab.txt``).

Why: the pipeline needs a default model that runs anywhere, offline, in seconds,
without downloading the gated multi-GB checkpoints. The weights are seeded random
numbers, so outputs are noise, but every real code path (config parsing, key
mapping, tokenizer, text encoder, DiT, codec, LoRA injection) is exercised.

Everything is deterministic: re-running with the same ``--seed`` reproduces every
file byte for byte. Keys and shapes come from the converter's tables in
``sa3mlx.convert`` (one source of truth); numpy, safetensors and tokenizers write.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

import sa3mlx  # noqa: F401  (first: sets up BLAS before anything imports mlx)
from sa3mlx.convert.dit import BUFFER_SUFFIX, DIT_PREFIX, torch_cond_shapes, torch_dit_shapes
from sa3mlx.convert.same import torch_same_shapes
from sa3mlx.convert.t5gemma import ENCODER_PREFIX, t5gemma_shapes
from sa3mlx.models.config import ModelConfig, T5GemmaConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB_FILE = Path(__file__).resolve().parent / "demo_vocab.txt"
SAME_PREFIX = "pretransform.model."

# name -> (HF repo id mirrored, diffusion objective, rng stream id)
VARIANTS = {
    "tiny-base": ("stabilityai/stable-audio-3-small-music-base", "rectified_flow", 0),
    "tiny-arc": ("stabilityai/stable-audio-3-small-music", "rf_denoiser", 1),
}
T5_STREAM = 2  # rng stream of the (shared) text encoder weights
T5_SUBFOLDER = "t5gemma-b-b-ul2"
T5_MODEL_NAME = "google/t5gemma-b-b-ul2"

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3
PUNCTUATION = [",", ".", "-", ":", "/", "_", "'", "(", ")", "&", "+"]
PROMPT_MAX_LENGTH = 64

# Tiny dimensions (same as the parity fixture ``dit_small``).
COND_DIM = 768  # hard-coded width of the official T5Gemma conditioner
TIMESTEP_FEATURES = 256  # Fourier features of the DiT timestep embedder


# ----------------------------------------------------------------------------
# model_config.json
# ----------------------------------------------------------------------------


def same_config(kind: str, mask_noise: float) -> dict:
    """Config of the SAME encoder/decoder (SAME-S layout, tiny widths)."""
    io = (
        {"in_channels": 512}
        if kind == "encoder"
        else {"out_channels": 512, "sinusoidal_blocks": [0], "conv_mapping": True}
    )
    return {
        "type": "same",
        "config": {
            **io,
            "channels": 16,
            "c_mults": [2],
            "strides": [16],
            "latent_dim": 16,
            "transformer_depths": [2],
            "checkpointing": False,
            "differential": True,
            "dyt": True,
            "dim_heads": 16,
            "variable_stride": True,
            "chunk_size": 32,
            "chunk_midpoint_shift": True,
            "mask_noise": mask_noise,
        },
    }


def pretransform_config() -> dict:
    """Patched SAME autoencoder with a SoftNorm bottleneck: 4096 samples/latent."""
    return {
        "type": "autoencoder",
        "iterate_batch": False,
        "chunked": False,
        "config": {
            "encoder": same_config("encoder", 0.0),
            "decoder": same_config("decoder", 0.01),
            "bottleneck": {
                "type": "softnorm",
                "config": {
                    "dim": 16,
                    "noise_augment_dim": 0,
                    "noise_regularize": True,
                    "auto_scale": True,
                    "freeze": True,
                },
            },
            "pretransform": {"type": "patched", "config": {"patch_size": 256, "channels": 2}},
            "latent_dim": 16,
            "downsampling_ratio": 4096,
            "io_channels": 2,
        },
    }


def conditioning_config(repo_id: str) -> dict:
    """Prompt (T5Gemma in a repo subfolder) + seconds_total conditioners."""
    return {
        "cond_dim": COND_DIM,
        "configs": [
            {
                "id": "prompt",
                "type": "t5gemma",
                "config": {
                    "model_name": T5_MODEL_NAME,
                    "repo_id": repo_id,
                    "subfolder": T5_SUBFOLDER,
                    "max_length": PROMPT_MAX_LENGTH,
                    "padding_mode": "learned",
                },
            },
            {
                "id": "seconds_total",
                "type": "number",
                "config": {"min_val": 0, "max_val": 384, "fourier_features_type": "expo"},
            },
        ],
    }


def diffusion_config(objective: str) -> dict:
    """Tiny DiT: 128 wide, 2 layers, 2 heads of 64, adaLN, 4 memory tokens."""
    return {
        "type": "dit",
        "diffusion_objective": objective,
        "cross_attention_cond_ids": ["prompt", "seconds_total"],
        "global_cond_ids": ["seconds_total"],
        "local_add_cond_ids": ["inpaint_mask", "inpaint_masked_input"],
        "distribution_shift_options": {"type": "full", "min_length": 256, "max_length": 4096},
        "mask_padding_attention": True,
        "use_effective_length_for_schedule": True,
        "config": {
            "io_channels": 16,
            "patch_size": 1,
            "embed_dim": 128,
            "depth": 2,
            "num_heads": 2,
            "cond_token_dim": COND_DIM,
            "project_cond_tokens": True,
            "global_cond_dim": COND_DIM,
            "transformer_type": "continuous_transformer",
            "global_cond_type": "adaLN",
            "timestep_cond_type": "global",
            "timestep_features_type": "expo",
            "timestep_features_dim": TIMESTEP_FEATURES,
            "timestep_features_logsnr": False,
            "num_memory_tokens": 4,
            "local_add_cond_dim": 17,
            "norm_type": "rms_norm",
            "attn_kwargs": {"qk_norm": "rms", "differential": False},
            "ff_kwargs": {"mult": 4},
        },
    }


def model_config(repo_id: str, objective: str) -> dict:
    """Full official-format model_config.json for one variant."""
    return {
        "model_type": "diffusion_cond_inpaint",
        "sample_size": 5292032,  # 1292 latents * 4096, as in the small models
        "sample_rate": 44100,
        "audio_channels": 2,
        "model": {
            "io_channels": 16,
            "pretransform": pretransform_config(),
            "conditioning": conditioning_config(repo_id),
            "diffusion": diffusion_config(objective),
        },
    }


# ----------------------------------------------------------------------------
# model.safetensors: keys and shapes from the converter's tables
# ----------------------------------------------------------------------------


def sa3_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Official state-dict layout: ``model.model.*`` DiT, conditioners, ``pretransform.model.*``."""
    return {
        **{DIT_PREFIX + k: v for k, v in torch_dit_shapes(cfg.dit).items()},
        **torch_cond_shapes(cfg.conditioner.cond_dim),
        **{SAME_PREFIX + k: v for k, v in torch_same_shapes(cfg.autoencoder).items()},
    }


def rope_inv_freq(shape: tuple[int, ...]) -> np.ndarray:
    """Official inv_freq = 1 / 10000 ** (arange(0, R, 2) / R), fp32; R = 2 * len."""
    r = 2 * shape[0]
    exps = np.arange(0, r, 2, dtype=np.float32) / np.float32(r)
    return (np.float32(1.0) / np.power(np.float32(10000.0), exps)).astype(np.float32)


def init_tensor(rng: np.random.Generator, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """Draw one tensor following the fixture conventions (float64 draw)."""
    leaf = key.rsplit(".", 1)[-1]
    if ".bottleneck." in key:
        if leaf == "scaling_factor":
            return 1.0 + 0.1 * rng.standard_normal(shape)
        if leaf == "bias":
            return 0.1 * rng.standard_normal(shape)
        if leaf == "running_std":
            return rng.uniform(0.6, 1.6, shape)
        return np.zeros(shape)  # noise_scaling_factor (empty when no noise augment)
    if leaf == "gamma":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if leaf in ("alpha", "weight_g"):
        return rng.uniform(0.5, 1.5, shape)
    if leaf == "beta":
        return 0.1 * rng.standard_normal(shape)
    if leaf == "memory_tokens":
        return rng.standard_normal(shape)
    if leaf in ("to_scale_shift_gate", "new_tokens", "padding_embedding"):
        return 0.5 * rng.standard_normal(shape)
    if leaf == "bias":
        return 0.05 * rng.standard_normal(shape)
    fan_in = math.prod(shape[1:])
    return rng.standard_normal(shape) / math.sqrt(fan_in)


def keep_fp32(key: str) -> bool:
    """Buffers that fp16 storage would damage stay float32."""
    return key.endswith(BUFFER_SUFFIX) or key.startswith(SAME_PREFIX + "bottleneck.")


def sa3_state_dict(cfg: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random full state dict in the official layout (keys drawn in sorted order)."""
    shapes = sa3_shapes(cfg)
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key.endswith(BUFFER_SUFFIX):
            arr = rope_inv_freq(shape)
        else:
            arr = init_tensor(rng, key, shape)
        out[key] = np.ascontiguousarray(arr, dtype=np.float32 if keep_fp32(key) else np.float16)
    return out


# ----------------------------------------------------------------------------
# t5gemma-b-b-ul2/: tokenizer, config, encoder weights
# ----------------------------------------------------------------------------


def read_vocab_words(path: Path) -> list[str]:
    """Words of demo_vocab.txt in file order, comments skipped, deduplicated."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        word = line.strip()
        if word and not word.startswith("#") and word not in words:
            words.append(word)
    return words


def build_vocab(words: list[str]) -> dict[str, int]:
    """Specials (pad, eos, bos, unk), demo words, digits, punctuation."""
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + words + [str(d) for d in range(10)] + PUNCTUATION:
        vocab.setdefault(tok, len(vocab))
    return vocab


def build_tokenizer(vocab: dict[str, int]) -> Tokenizer:
    """WordLevel tokenizer: NFKC+lowercase, whitespace/punct split, single digits."""
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json (transformers tokenizers backend)."""
    return {
        "backend": "tokenizers",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "model_max_length": PROMPT_MAX_LENGTH,
        "pad_token": "<pad>",
        "tokenizer_class": "TokenizersBackend",
        "unk_token": "<unk>",
    }


def t5_module_config(vocab_size: int, *, is_decoder: bool) -> dict:
    """One T5GemmaModuleConfig (encoder or decoder half)."""
    cfg = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "dropout_rate": 0.0,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 64,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": COND_DIM,
        "initializer_range": 0.02,
        "intermediate_size": 32,
        "is_decoder": is_decoder,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 8192,
        "model_type": "t5_gemma_module",
        "num_attention_heads": 1,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 4096,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if is_decoder:
        cfg["cross_attention_hidden_size"] = COND_DIM
    return dict(sorted(cfg.items()))


def t5_config(vocab_size: int) -> dict:
    """T5GemmaConfig with encoder and decoder sub-configs (HF config.json)."""
    return {
        "architectures": ["T5GemmaEncoderModel"],
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "classifier_dropout_rate": 0.0,
        "decoder": t5_module_config(vocab_size, is_decoder=True),
        "dropout_rate": 0.0,
        "dtype": "float32",
        "encoder": t5_module_config(vocab_size, is_decoder=False),
        "eos_token_id": 1,
        "initializer_range": 0.02,
        "is_encoder_decoder": False,
        "model_type": "t5gemma",
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "transformers_version": "5.24.0",
        "vocab_size": vocab_size,
    }


def t5_encoder_state_dict(cfg: T5GemmaConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random encoder-only weights with HF T5Gemma names, fp16 storage."""
    shapes = {ENCODER_PREFIX + k: v for k, v in t5gemma_shapes(cfg).items()}
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key.endswith("embed_tokens.weight"):
            arr = rng.standard_normal(shape) / math.sqrt(cfg.hidden_size)  # x sqrt(d) -> O(1)
        elif len(shape) == 1:
            arr = 0.1 * rng.standard_normal(shape)  # Gemma RMSNorm scales by (1 + w)
        else:
            arr = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[key] = np.ascontiguousarray(arr, dtype=np.float16)
    return out


# ----------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_t5_folder(folder: Path, tok: Tokenizer, cfg: dict, weights: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", cfg)
    write_json(folder / "tokenizer_config.json", tokenizer_config())
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_variant(
    folder: Path, repo_id: str, objective: str, rng: np.random.Generator, t5: tuple[Tokenizer, dict, dict]
) -> dict[str, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model_config(repo_id, objective)
    write_json(folder / "model_config.json", cfg)
    weights = sa3_state_dict(ModelConfig.from_dict(cfg), rng)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_t5_folder(folder / T5_SUBFOLDER, *t5)
    return weights


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=REPO_ROOT / "models",
        help="parent folder of tiny-base/ and tiny-arc/ (default: <repo>/models)",
    )
    ap.add_argument("--seed", type=int, default=0, help="base seed of all weights")
    args = ap.parse_args(argv)

    tok = build_tokenizer(build_vocab(read_vocab_words(VOCAB_FILE)))
    t5_cfg = t5_config(tok.get_vocab_size(with_added_tokens=True))
    t5_weights = t5_encoder_state_dict(T5GemmaConfig.from_hf(t5_cfg), np.random.default_rng([args.seed, T5_STREAM]))

    total = 0
    for name, (repo_id, objective, stream) in VARIANTS.items():
        folder = args.out_dir / name
        rng = np.random.default_rng([args.seed, stream])
        weights = write_variant(folder, repo_id, objective, rng, (tok, t5_cfg, t5_weights))
        size = folder_bytes(folder)
        total += size
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        print(f"{folder}: {objective}, {len(weights)} SA3 tensors, {len(t5_weights)} T5Gemma tensors, {size:,} bytes")
        for f in files:
            print(f"  {f}")
    print(f"tokenizer vocab {tok.get_vocab_size()}, total {total:,} bytes")


if __name__ == "__main__":
    main()
