"""SVD base files for the -xs adapters: computed once per converted base (the `svd` stage),
read by training and merging.

File: `svd_bases.safetensors`, fp32 tensors `<layer>.U` (fan_out, r), `<layer>.V` (fan_in, r),
`<layer>.S` (r,) under checkpoint-convention layer names, r = min(max_rank, fan_out, fan_in),
plus one metadata key `svd_config` (JSON: source file and its sha256, the precision the
weights were in when decomposed, max_rank, sign rule).

The -xs hazard: adapter files never hold U/V, so an -xs adapter reproduces only where the
same bases are rebuilt: same base weights, same precision, same sign rule. Bases of an fp16
base computed from fp32 weights (or the reverse) differ enough to change the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from sa3mlx.convert.checkpoint import CheckpointError, read_npz, read_safetensors
from sa3mlx.lora.maths import mlx_weight_to_2d
from sa3mlx.lora.svd import svd_bases
from sa3mlx.lora.targeting import adaptable_layers, npz_weight_key
from sa3mlx.models.config import DiTConfig, ModelConfig
from sa3mlx.runtime.io import atomic_path, sha256_file
from sa3mlx.runtime.layout import DIT_FILE, MODEL_CONFIG_FILE, SVD_FILE

METADATA_KEY = "svd_config"
SIGN_RULE = "largest-|U| entry of every column positive"
PRECISIONS = ("stored", "float32", "float16", "bfloat16")
MIN_DIM = 2  # layers with min(fan_out, fan_in) below this get no bases (as underfit's compute_svd)


def weights_in_precision(weight: np.ndarray, precision: str) -> tuple[np.ndarray, str]:
    """(fp32 copy of the weight as training sees it, the name of that precision). `stored` keeps
    the file's dtype; the others round to that dtype first."""
    if precision not in PRECISIONS:
        raise ValueError(f"svd precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if precision == "stored" or precision == "float32":
        name = str(weight.dtype) if precision == "stored" else "float32"
        return weight.astype(np.float32), name
    if precision == "float16":
        return weight.astype(np.float16).astype(np.float32), "float16"
    bits = weight.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # round to nearest even, as bf16 casts do
    return rounded.astype(np.uint32).view(np.float32), "bfloat16"


def model_bases(
    arrays: dict[str, np.ndarray], dit: DiTConfig, cond_dim: int, max_rank: int, precision: str = "stored"
) -> tuple[dict[str, dict[str, np.ndarray]], str]:
    """Bases of every adaptable layer of converted dit.npz arrays (name -> {U, V, S}) and the
    precision the weights were decomposed in."""
    out, used = {}, "float32"
    for layer in adaptable_layers(dit, cond_dim):
        if min(layer.fan_out, layer.fan_in) < MIN_DIM:
            continue
        weight, used = weights_in_precision(arrays[npz_weight_key(layer.name)], precision)
        out[layer.name] = svd_bases(mlx_weight_to_2d(weight), max_rank)
    return out, used


def compute_svd_file(
    converted_dir: str | Path, out_dir: str | Path, max_rank: int = 64, precision: str = "stored"
) -> Path:
    """The `svd` stage: bases of `<converted_dir>/dit.npz` into `<out_dir>/svd_bases.safetensors`."""
    converted_dir = Path(converted_dir)
    source = converted_dir / DIT_FILE
    config = ModelConfig.load(converted_dir / MODEL_CONFIG_FILE)
    origin = {"source": source.name, "source_sha256": sha256_file(source)}
    return write_svd_file(
        out_dir, read_npz(source), config.dit, config.conditioner.cond_dim, max_rank, precision, origin
    )


def write_svd_file(
    out_dir: str | Path,
    arrays: dict[str, np.ndarray],
    dit: DiTConfig,
    cond_dim: int,
    max_rank: int,
    precision: str,
    origin: dict,
) -> Path:
    bases, used = model_bases(arrays, dit, cond_dim, max_rank, precision)
    metadata = {**origin, "precision": used, "max_rank": max_rank, "sign_rule": SIGN_RULE, "layers": len(bases)}
    return save_bases(Path(out_dir) / SVD_FILE, bases, metadata)


def save_bases(path: str | Path, bases: dict[str, dict[str, np.ndarray]], metadata: dict) -> Path:
    """fp32 safetensors, one metadata key (deterministic bytes for the same inputs)."""
    tensors = {
        f"{name}.{part}": np.ascontiguousarray(value, dtype=np.float32)
        for name, parts in bases.items()
        for part, value in parts.items()
    }
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True)})
    return Path(path)


def read_bases(path: str | Path, allow_pickle: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """Bases by checkpoint-convention layer name, from our file (or a folder holding it), or from
    underfit's `compute_svd` .pt (pickle: only with allow_pickle, needs torch)."""
    path = Path(path)
    if path.is_dir():
        path = path / SVD_FILE
    if path.suffix == ".pt":
        return _read_underfit_pt(path, allow_pickle)
    if not path.is_file():
        raise CheckpointError(f"{path}: no SVD base file (run the svd stage)")
    tensors, _ = read_safetensors(path)
    bases: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        name, _, part = key.rpartition(".")
        bases.setdefault(name, {})[part] = value.astype(np.float32)
    return bases


def bases_if_present(folder: str | Path) -> dict[str, dict[str, np.ndarray]] | None:
    """The svd stage's bases in `folder` (e.g. models/svd/<base>), or None when it has none."""
    return read_bases(folder) if (Path(folder) / SVD_FILE).is_file() else None


def layer_bases(svd: dict[str, dict[str, np.ndarray]] | None, name: str, rank: int) -> dict[str, np.ndarray] | None:
    """A layer's entry of a base file, checked to hold at least `rank` columns; None when absent."""
    entry = (svd or {}).get(name)
    if entry is not None:
        columns, full = entry["U"].shape[1], min(entry["U"].shape[0], entry["V"].shape[0])
        if columns < min(rank, full):
            raise ValueError(
                f"{name}: the SVD base file keeps {columns} columns but the adapter has rank {rank}; "
                f"rerun the svd stage with svd.max_rank >= {rank}"
            )
    return entry


def bases_metadata(path: str | Path) -> dict:
    path = Path(path)
    _, metadata = read_safetensors(path / SVD_FILE if path.is_dir() else path)
    return json.loads(metadata.get(METADATA_KEY, "{}"))


def _read_underfit_pt(path: Path, allow_pickle: bool) -> dict[str, dict[str, np.ndarray]]:
    """underfit's `{state-dict key: {U, V, S, shape}}` (fp16 U/V) -> our names, fp32."""
    if not allow_pickle:
        raise CheckpointError(
            f"{path}: refusing to read a pickle file (it can run arbitrary code); "
            "pass allow_pickle=True (needs torch) or use the svd stage's safetensors"
        )
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path}: allow_pickle is set but torch is not installed") from None
    raw = torch.load(path, map_location="cpu", weights_only=True)
    bases = {}
    for key, entry in raw.items():
        name = key.removesuffix(".weight")
        root = "conditioner." if name.startswith("conditioner.") else "model."
        name = name.removeprefix(root)
        bases[name] = {part: entry[part].float().numpy() for part in ("U", "V", "S") if part in entry}
    return bases
