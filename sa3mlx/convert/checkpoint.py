"""Reading checkpoints without torch: safetensors (bf16 included), npz, and guarded pickles."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from sa3mlx.runtime.artifacts import load_npz
from sa3mlx.runtime.errors import UserError

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read, or whose keys/shapes are wrong; names the file."""


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def read_safetensors_header(path: str | Path) -> tuple[dict[str, dict], dict[str, str], int]:
    """(tensor entries, metadata, body offset) of a .safetensors file, every entry checked."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len == 0 or header_len > size - 8:
            raise CheckpointError(f"{path}: header length {header_len} does not fit a {size}-byte file")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    for name, info in header.items():
        _check_entry(path, name, info, size - 8 - header_len)
    return header, metadata, 8 + header_len


def _check_entry(path: Path, name: str, info, body_size: int) -> None:
    try:
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: tensor '{name}' has a malformed or unsupported header entry") from None
    if not 0 <= start <= end <= body_size or end - start != count * dtype.itemsize:
        raise CheckpointError(f"{path}: tensor '{name}' lies outside the file or has inconsistent offsets (truncated?)")


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a .safetensors file (bf16 widened to fp32) and its metadata."""
    header, metadata, body_offset = read_safetensors_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        raw = np.frombuffer(
            data[body_offset + start : body_offset + end], dtype=_SAFETENSORS_DTYPES[info["dtype"]]
        ).reshape(info["shape"])
        tensors[name] = bf16_to_f32(raw) if info["dtype"] == "BF16" else np.array(raw)
    return tensors, metadata


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an .npz (checked against the manifest beside it, when there is one)."""
    return load_npz(path, "arrays")


def read_pickle_checkpoint(path: str | Path, allow_pickle: bool) -> dict[str, np.ndarray]:
    """A torch .ckpt/.pt state dict, only when the user opted in and torch is installed."""
    path = Path(path)
    if not allow_pickle:
        raise CheckpointError(
            f"{path}: refusing to read a pickle checkpoint (it can run arbitrary code). "
            "Convert it to .safetensors, or set convert.allow_pickle: true (needs torch installed)."
        )
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path}: convert.allow_pickle is set but torch is not installed") from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    return {
        k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items() if hasattr(v, "numpy")
    }


def read_checkpoint(path: str | Path, allow_pickle: bool = False) -> dict[str, np.ndarray]:
    """Tensors of any supported checkpoint file, keyed by their stored names."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.suffix == ".safetensors":
        return read_safetensors(path)[0]
    if path.suffix == ".npz":
        return read_npz(path)
    if path.suffix in PICKLE_SUFFIXES:
        return read_pickle_checkpoint(path, allow_pickle)
    raise CheckpointError(f"{path}: unknown checkpoint format (expected .safetensors, .npz or .ckpt)")
