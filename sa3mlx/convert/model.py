"""Convert an SA3 source (HF model folder, SAME repo, T5Gemma folder or one checkpoint
file) into the MLX files of `models/converted/<name>/`.

Layout of a converted SA3 model folder:
    dit.npz            DiT + conditioner tensors (official MLX runtime key names)
    same_encoder.npz   SAME encoder + SoftNorm encode params (weight norm fused)
    same_decoder.npz   SAME decoder + bottleneck.running_std (weight norm fused)
    t5gemma.npz        T5Gemma encoder weights (HF names without `encoder.`)
    t5gemma/           its config.json and tokenizer files
    model_config.json  the source config, unchanged
    manifest.json      source, variant, and per file: keys, dtype, sha256
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sa3mlx.convert import dit as dit_keys
from sa3mlx.convert.checkpoint import PICKLE_SUFFIXES, CheckpointError, read_checkpoint
from sa3mlx.convert.same import same_to_mlx, torch_same_shapes
from sa3mlx.convert.t5gemma import TOKENIZER_FILES, t5gemma_shapes, t5gemma_to_mlx
from sa3mlx.convert.validate import validate_shapes
from sa3mlx.models.config import AutoencoderConfig, DiTConfig, ModelConfig, T5GemmaConfig
from sa3mlx.runtime.io import atomic_path, save_json, save_npz, sha256_file
from sa3mlx.runtime.layout import (
    CHECKPOINT_FILE,
    DIT_FILE,
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    SAME_DECODER_FILE,
    SAME_ENCODER_FILE,
    T5GEMMA_DIR,
    T5GEMMA_FILE,
)
from sa3mlx.runtime.precision import NUMPY_STORAGE

CHECKPOINT_NAMES = (CHECKPOINT_FILE, "model.ckpt", "model.pt")


@dataclass(frozen=True)
class ConvertOptions:
    dit_dtype: str = "float16"
    same_dtype: str = "float32"
    t5gemma_dtype: str = "float16"
    allow_pickle: bool = False
    dit_only: bool = False  # a lone checkpoint file without model_config.json: write its DiT alone, said so

    @classmethod
    def from_params(cls, params: dict) -> ConvertOptions:
        return cls(
            dit_dtype=params["dit_dtype"],
            same_dtype=params["same_dtype"],
            t5gemma_dtype=params["t5gemma_dtype"],
            allow_pickle=bool(params["allow_pickle"]),
        )


def cast_floats(arrays: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Storage cast of float tensors; RoPE `inv_freq` buffers stay fp32 (fp16 would skew angles)."""
    target = NUMPY_STORAGE[dtype]

    def cast(key: str, value: np.ndarray) -> np.ndarray:
        if value.dtype.kind != "f":
            return value
        return value.astype(np.float32 if key.endswith(dit_keys.BUFFER_SUFFIX) else target)

    return {key: cast(key, value) for key, value in arrays.items()}


def find_checkpoint(folder: Path) -> Path:
    for name in CHECKPOINT_NAMES:
        if (folder / name).is_file():
            return folder / name
    candidates = sorted(folder.glob("*.safetensors"))
    if len(candidates) == 1:
        return candidates[0]
    raise CheckpointError(f"{folder}: no model.safetensors (or single *.safetensors) checkpoint found")


def convert_source(source: str | Path, out_dir: str | Path, options: ConvertOptions = ConvertOptions()) -> dict:
    """Convert whatever `source` is; returns the manifest written to out_dir/manifest.json."""
    source, out_dir = Path(source), Path(out_dir)
    if source.is_dir():
        config_file = source / MODEL_CONFIG_FILE
        if config_file.is_file():
            kind = json.loads(config_file.read_text()).get("model_type")
            if kind == "autoencoder":
                return convert_same_folder(source, out_dir, options)
            return convert_sa3_folder(source, out_dir, options)
        if (source / "config.json").is_file():
            return convert_t5gemma_folder(source, out_dir, options)
        raise CheckpointError(
            f"{source}: neither an SA3/SAME folder (model_config.json) nor a T5Gemma folder (config.json)"
        )
    return convert_checkpoint_file(source, out_dir, options)


def convert_sa3_folder(folder: Path, out_dir: Path, options: ConvertOptions, checkpoint: Path | None = None) -> dict:
    config = ModelConfig.load(folder / MODEL_CONFIG_FILE)
    checkpoint = checkpoint or find_checkpoint(folder)
    state = read_checkpoint(checkpoint, options.allow_pickle)
    files = {}
    if _is_mlx_dit(state):
        files[DIT_FILE] = _mlx_dit(state, config.dit, config.conditioner.cond_dim, checkpoint, options)
    else:
        dit, cond, same = dit_keys.split_sa3_state(state)
        _check_unclaimed(state, checkpoint)
        files[DIT_FILE] = _torch_dit(dit, cond, config.dit, config.conditioner.cond_dim, checkpoint, options)
        files.update(_same_files(same, config.autoencoder, checkpoint, options))
    text_folder = (folder / config.conditioner.prompt.encoder_path).resolve()
    if text_folder.is_dir():
        files.update(_t5gemma_files(text_folder, out_dir, options))
    _copy_config(folder, out_dir)
    return _finish(out_dir, files, checkpoint, variant=config.variant, objective=config.objective)


def convert_same_folder(folder: Path, out_dir: Path, options: ConvertOptions) -> dict:
    config = AutoencoderConfig.from_standalone(json.loads((folder / MODEL_CONFIG_FILE).read_text()))
    checkpoint = find_checkpoint(folder)
    state = read_checkpoint(checkpoint, options.allow_pickle)
    if any(k.startswith("pretransform.model.") for k in state):
        state = dit_keys.split_sa3_state(state)[2]
    files = _same_files(state, config, checkpoint, options)
    _copy_config(folder, out_dir)
    return _finish(out_dir, files, checkpoint, variant="same")


def convert_t5gemma_folder(folder: Path, out_dir: Path, options: ConvertOptions) -> dict:
    files = _t5gemma_files(folder, out_dir, options)
    return _finish(out_dir, files, folder, variant="t5gemma")


def convert_checkpoint_file(path: Path, out_dir: Path, options: ConvertOptions) -> dict:
    """One SA3 checkpoint file: a complete folder when its model_config.json lies beside it; without one,
    refused (the objective, codec and text-encoder settings are not in the weights) unless `dit_only`."""
    sibling = path.parent / MODEL_CONFIG_FILE
    if path.suffix not in (".safetensors", ".npz") + PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: unknown checkpoint format")
    if sibling.is_file() and json.loads(sibling.read_text()).get("model_type") != "autoencoder":
        return convert_sa3_folder(path.parent, out_dir, options, checkpoint=path)
    state = read_checkpoint(path, options.allow_pickle)
    if not options.dit_only:
        raise CheckpointError(_lone_file_refusal(path, state))
    if _is_mlx_dit(state):
        torch_like = {dit_keys.dit_key_to_torch(k): v for k, v in state.items() if not k.startswith("cond.")}
        dit_cfg = dit_config_from_weights(torch_like, path)
        cond_dim = state["cond.padding_embedding"].shape[0]
        files = {DIT_FILE: _mlx_dit(state, dit_cfg, cond_dim, path, options)}
    else:
        dit, cond, _ = dit_keys.split_sa3_state(state)
        if not dit:
            raise CheckpointError(f"{path}: no `model.model.*` DiT tensors; is this an SA3 checkpoint?")
        dit_cfg = dit_config_from_weights(dit, path)
        cond_dim = dit_cfg.cond_token_dim
        files = {DIT_FILE: _torch_dit(dit, cond, dit_cfg, cond_dim, path, options)}
    inferred = {**dit_cfg.__dict__, "cond_dim": cond_dim}
    return _finish(out_dir, files, path, variant="dit only (no model_config.json)", inferred_dit=inferred)


def _lone_file_refusal(path: Path, state: dict) -> str:
    """What a lone checkpoint holds, what a loadable converted folder still needs, and the ways on."""
    same = sum(k.startswith("pretransform.") for k in state)
    held = f"{len(state) - same} DiT/conditioner tensors" + (
        f" and {same} SAME codec (pretransform.*) tensors" if same else ""
    )
    return (
        f"{path}: holds {held}, but no model_config.json lies beside it: the diffusion objective, the codec and "
        "text-encoder settings are not in the weights, so no loadable folder can be made from it. Put the "
        "model_config.json of its Hugging Face repo (and its t5gemma-b-b-ul2/ folder) beside it, or convert the "
        "whole repo folder; --dit-only writes its DiT alone (dit.npz + manifest, no codec, no text encoder)"
    )


def dit_config_from_weights(dit: dict[str, np.ndarray], source: Path) -> DiTConfig:
    sizes = dit_keys.infer_dit_config(dit)
    needed = ("embed_dim", "io_channels", "dim_head", "ff_inner", "differential")
    if any(n not in sizes for n in needed):
        raise CheckpointError(f"{source}: cannot infer the DiT sizes from its keys (missing core tensors)")
    E = sizes["embed_dim"]
    return DiTConfig(
        io_channels=sizes["io_channels"],
        embed_dim=E,
        depth=sizes["depth"],
        num_heads=E // sizes["dim_head"],
        cond_token_dim=sizes.get("cond_token_dim", 768),
        global_cond_dim=sizes.get("cond_token_dim", 768),
        local_add_cond_dim=sizes.get("local_add_cond_dim", 0),
        num_memory_tokens=sizes.get("num_memory_tokens", 0),
        timestep_features_dim=sizes.get("timestep_features_dim", 256),
        ff_inner=sizes["ff_inner"],
        differential=sizes["differential"],
    )


def _is_mlx_dit(state: dict) -> bool:
    return "cond.padding_embedding" in state and not any(k.startswith(dit_keys.DIT_PREFIX) for k in state)


def _check_unclaimed(state: dict, source: Path) -> None:
    prefixes = (dit_keys.DIT_PREFIX, dit_keys.COND_PREFIX, "pretransform.model.")
    stray = sorted(k for k in state if not k.startswith(prefixes))
    if stray:
        validate_shapes({k: state[k] for k in stray}, {}, source, "SA3 checkpoint")


def _config_mismatch(dit: dict, cfg: DiTConfig) -> str:
    inferred = dit_keys.infer_dit_config(dit)
    declared = {**cfg.__dict__, "dim_head": cfg.dim_head}
    diffs = [
        f"{k}: config {declared[k]}, weights {v}" for k, v in inferred.items() if k in declared and declared[k] != v
    ]
    return ("model_config.json does not match the weights (" + "; ".join(diffs) + ")\n") if diffs else ""


def _torch_dit(dit, cond, cfg: DiTConfig, cond_dim: int, source: Path, options) -> np.ndarray:
    expected = dit_keys.torch_dit_shapes(cfg)
    try:
        validate_shapes(dit, expected, source, "DiT (model.model.*)")
    except CheckpointError as e:
        raise CheckpointError(_config_mismatch(dit, cfg) + str(e)) from None
    validate_shapes(cond, dit_keys.torch_cond_shapes(cond_dim), source, "conditioner")
    return cast_floats(dit_keys.dit_to_mlx(dit, cond), options.dit_dtype)


def _mlx_dit(state, cfg: DiTConfig, cond_dim: int, source: Path, options) -> dict:
    validate_shapes(state, dit_keys.mlx_dit_shapes(cfg, cond_dim), source, "MLX DiT npz")
    return cast_floats(state, options.dit_dtype)


def _same_files(same: dict, cfg: AutoencoderConfig, source: Path, options) -> dict:
    validate_shapes(same, torch_same_shapes(cfg), source, "SAME codec")
    encoder, decoder = same_to_mlx(same)
    return {
        SAME_ENCODER_FILE: cast_floats(encoder, options.same_dtype),
        SAME_DECODER_FILE: cast_floats(decoder, options.same_dtype),
    }


def _t5gemma_files(folder: Path, out_dir: Path, options) -> dict:
    config = T5GemmaConfig.load(folder)
    weights = find_checkpoint(folder)
    encoder = t5gemma_to_mlx(read_checkpoint(weights, options.allow_pickle))
    validate_shapes(encoder, t5gemma_shapes(config), weights, "T5Gemma encoder")
    text_dir = out_dir / T5GEMMA_DIR
    text_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json",) + TOKENIZER_FILES:
        if (folder / name).is_file():
            with atomic_path(text_dir / name) as tmp:
                shutil.copyfile(folder / name, tmp)
    return {T5GEMMA_FILE: cast_floats(encoder, options.t5gemma_dtype)}


def _copy_config(folder: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / MODEL_CONFIG_FILE) as tmp:
        shutil.copyfile(folder / MODEL_CONFIG_FILE, tmp)


def _finish(out_dir: Path, files: dict[str, dict], source: Path, **info) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"source": source.name, **info, "weight_norm": "fused into mapping.weight", "files": {}}
    for name, arrays in files.items():
        save_npz(out_dir / name, arrays)
        dtypes = sorted({str(a.dtype) for a in arrays.values()})
        manifest["files"][name] = {"keys": len(arrays), "dtypes": dtypes, "sha256": sha256_file(out_dir / name)}
    save_json(out_dir / MANIFEST_FILE, manifest)
    return manifest
