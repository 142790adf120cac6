"""The one home of the on-disk layout and the SA3 constants every layer shares.

Stage folders are relative to the project root (where `dvc.yaml` lives); the stages, the library and
the tests build every path from here, so a folder or file name is spelled once.
"""

from __future__ import annotations

from pathlib import Path

# SA3 constants (fixed by the architecture; every shipped model_config.json agrees)
SAMPLE_RATE = 44100  # Hz: the codecs' rate
SAMPLES_PER_LATENT = 4096  # audio samples per SAME latent frame (the codecs' downsampling ratio)
SECONDS_FEATURES = 256  # width of the seconds_total embedder's ExpoFourierFeatures

# A Hugging Face SA3 repo snapshot under models/<name>/
MODEL_CONFIG_FILE = "model_config.json"
CHECKPOINT_FILE = "model.safetensors"
T5GEMMA_SOURCE_DIR = "t5gemma-b-b-ul2"

# A converted model folder models/converted/<name>/
DIT_FILE = "dit.npz"
SAME_ENCODER_FILE = "same_encoder.npz"
SAME_DECODER_FILE = "same_decoder.npz"
T5GEMMA_FILE = "t5gemma.npz"
T5GEMMA_DIR = "t5gemma"  # its config.json + tokenizer files
MANIFEST_FILE = "manifest.json"

# data/latents/ after an `encode.shard` run: which share it holds (an unsharded run removes it)
ENCODE_SHARE_FILE = "encode_share.json"

# models/svd/<name>/
SVD_FILE = "svd_bases.safetensors"

# Stage folders
RAW_DIR = "data/raw"
NORMALIZED_DIR = "data/normalized"
LATENTS_DIR = "data/latents"
ENCODE_CACHE_DIR = "data/encode_cache"
MODELS_DIR = "models"
CONVERTED_DIR = "models/converted"
SVD_DIR = "models/svd"
LORA_DIR = "models/lora"
RUNS_DIR = "runs"
DEMOS_DIR = "demos"
DVCLIVE_TRAIN_DIR = "dvclive/train"
DVC_FILE = "dvc.yaml"
PARAMS_FILE = "params.yaml"


def source_model_dir(name: str) -> Path:
    """models/<name>/: the Hugging Face snapshot a converted folder is made from."""
    return Path(MODELS_DIR) / name


def converted_dir(name: str) -> Path:
    return Path(CONVERTED_DIR) / name


def svd_dir(name: str) -> Path:
    return Path(SVD_DIR) / name


def adapter_path(run_name: str) -> Path:
    """models/lora/<name>.safetensors: the train stage's final adapter (what demo renders)."""
    return Path(LORA_DIR) / f"{run_name}.safetensors"


def run_dir(run_name: str) -> Path:
    return Path(RUNS_DIR) / run_name
