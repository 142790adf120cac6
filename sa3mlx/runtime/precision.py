"""The one device-precision policy: storage dtypes, compute dtypes, device set-up, compile notice.

- CPU: MLX's CPU matmul in fp16/bf16 is ~20x slower than fp32, so every computation runs in
  fp32 whatever the weights are stored in.
- GPU (Metal, CUDA): the frozen base computes in its storage dtype (fp16/bf16); adapters, their
  gradients and the optimizer state stay fp32 (`sa3mlx.lora.layers`; underfit's mixed regime); an
  adapted layer's output is cast back to the base's compute dtype so activations stay narrow.
- Metal: the wired-memory limit is raised to the GPU's recommended working set, as SA3's
  official MLX trainer and mlx-lm do (`configure_device`).
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
NUMPY_STORAGE = {"float32": np.float32, "float16": np.float16}
STORED = "stored"  # load weights as their file stores them (fp16 on the CPU too; each op still computes in fp32)
COMPUTE = "compute"  # load weights cast to the device's compute dtype (fp32 on the CPU)


def parse_dtype(name: str) -> mx.Dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype '{name}' (expected one of {', '.join(DTYPES)})") from None


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def compute_dtype(storage: mx.Dtype) -> mx.Dtype:
    """dtype to compute in for weights stored as `storage` on the current device."""
    if on_cpu() and storage in (mx.float16, mx.bfloat16):
        return mx.float32
    return storage


def configure_device() -> str:
    """Set the default device up for training; a one-line description of it."""
    device = mx.default_device()
    if on_cpu():
        return f"device: {device} (fp32 compute)"
    info = mx.device_info()
    name = info.get("device_name") or info.get("architecture") or "GPU"
    if mx.metal.is_available():
        limit = int(info["max_recommended_working_set_size"])
        mx.set_wired_limit(limit)
        return f"device: {device} {name} (Metal; wired limit {limit / 1e9:.1f} GB; base in its storage dtype)"
    return f"device: {device} {name} (base in its storage dtype, fp32 adapters and optimizer)"


def cpu_compile_cache() -> Path:
    """Where MLX caches the C++ kernels `mx.compile` builds on the CPU."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def _compile_marker(what: str, arrays) -> Path:
    """A file in the kernel cache that says this function was compiled for these shapes and dtypes."""
    leaves = [v for _, v in tree_flatten(list(arrays)) if isinstance(v, mx.array)]
    signature = repr([what, mx.__version__, [(tuple(a.shape), str(a.dtype)) for a in leaves]])
    return cpu_compile_cache() / "sa3mlx-compiled" / hashlib.sha1(signature.encode()).hexdigest()


@contextmanager
def compile_notice(what: str, *arrays):
    """Around the first call of a compiled function: one line before a CPU compile that this machine's
    kernel cache has not seen for these shapes (15-40 s per function on a cold cache)."""
    marker = _compile_marker(what, arrays) if on_cpu() else None
    cold = marker is not None and not marker.exists()
    if cold:
        print(
            f"sa3mlx: compiling {what} for the CPU (first run only, ~15-40 s; cached in {cpu_compile_cache()})",
            file=sys.stderr,
            flush=True,
        )
    yield
    if cold:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
