"""The device path, testable on the CPU: which MLX build `./dev` installs, and the precision policy
(fp32 on the CPU; on a GPU the frozen base in its storage dtype with fp32 adapters, gradients and
optimizer state; Metal's wired-memory limit)."""

import os
import subprocess

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import ROOT

from sa3mlx.lora.layers import LoRALinear
from sa3mlx.runtime import precision
from sa3mlx.train.optim import AdamWConfig, make_adamw


def backend(tmp_path, uname="Linux", gpus=None, forced=None) -> subprocess.CompletedProcess:
    """`./dev backend` with fake `uname` and (optionally) `nvidia-smi` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {"uname": f"echo {uname}"}
    if gpus is not None:
        fakes["nvidia-smi"] = f"printf '{gpus}'"
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SA3MLX_MLX_BACKEND"}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    if forced is not None:
        env["SA3MLX_MLX_BACKEND"] = forced
    return subprocess.run(["bash", str(ROOT / "dev"), "backend"], env=env, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("uname", "gpus", "forced", "expected"),
    [
        ("Linux", None, None, "cpu"),
        ("Linux", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\\n", None, "cuda"),
        ("Linux", "No devices were found\\n", None, "cpu"),
        ("Linux", "GPU 0: NVIDIA A10\\n", "cpu", "cpu"),
        ("Linux", None, "cuda", "cuda"),
        ("Linux", None, "cuda13", "cuda13"),
        ("Darwin", "GPU 0: anything\\n", None, "metal"),
    ],
)
def test_dev_picks_the_mlx_build(tmp_path, uname, gpus, forced, expected):
    result = backend(tmp_path, uname, gpus, forced)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_dev_rejects_an_unknown_backend(tmp_path):
    result = backend(tmp_path, forced="rocm")
    assert result.returncode == 2 and "SA3MLX_MLX_BACKEND=rocm" in result.stderr


def test_pyproject_extras_match_the_backends():
    text = (ROOT / "pyproject.toml").read_text()
    for extra, wheel in (("cpu", "mlx[cpu]"), ("cuda", "mlx[cuda12]"), ("cuda13", "mlx[cuda13]")):
        assert f"{extra} = [\"{wheel}>=0.30; sys_platform == 'linux'\"]" in text
    assert "mlx[cpu]>=0.30; sys_platform == 'linux'\",\n    \"mlx>=0.30" not in text  # no backend in the base


def test_cpu_computes_in_fp32():
    assert precision.on_cpu()
    for storage in (mx.float16, mx.bfloat16, mx.float32):
        assert precision.compute_dtype(storage) == mx.float32
    assert precision.configure_device() == f"device: {mx.default_device()} (fp32 compute)"


@pytest.fixture
def as_gpu(monkeypatch):
    """The policy as a GPU sees it (arrays still computed on the CPU)."""
    monkeypatch.setattr(precision, "on_cpu", lambda: False)


@pytest.mark.parametrize("storage", [mx.float16, mx.bfloat16])
def test_gpu_base_in_storage_dtype_adapters_grads_and_moments_fp32(as_gpu, storage):
    assert precision.compute_dtype(storage) == storage
    base = nn.Linear(32, 24, bias=True)
    base.update(nn.utils.tree_map(lambda p: p.astype(storage), base.parameters()))
    layer = LoRALinear(base, "dora-rows", 4, key=mx.random.key(0), materialize=False)
    layer.lora_B = mx.random.normal(layer.lora_B.shape, key=mx.random.key(1)) * 0.1
    x = mx.random.normal((2, 5, 32), key=mx.random.key(2)).astype(storage)
    assert layer(x).dtype == storage  # activations stay in the base's dtype
    assert all(v.dtype == mx.float32 for v in layer.lora_state().values())
    fn = nn.value_and_grad(layer, lambda x_: layer(x_).astype(mx.float32).square().mean())
    _, grads = fn(x)
    flat = dict(nn.utils.tree_flatten(grads))
    assert {k for k in flat} >= {"lora_A", "lora_B"} and all(flat[k].dtype == mx.float32 for k in layer.lora_state())
    optimizer = make_adamw(AdamWConfig(1e-3, (0.9, 0.95), 1e-8, 0.01))
    params = dict(layer.lora_state())
    optimizer.init(params)
    updated = optimizer.apply_gradients({k: flat[k] for k in params}, params)
    assert all(v.dtype == mx.float32 for v in updated.values())
    moments = {k: v for k, v in nn.utils.tree_flatten(optimizer.state) if k.split(".")[-1] in ("m", "v")}
    assert len(moments) == 2 * len(params) and all(v.dtype == mx.float32 for v in moments.values())


def test_metal_raises_the_wired_limit(as_gpu, monkeypatch):
    calls = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(
        mx, "device_info", lambda: {"device_name": "Apple M3", "max_recommended_working_set_size": 12e9}
    )
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 0)
    line = precision.configure_device()
    assert calls == [12_000_000_000]
    assert "Apple M3 (Metal; wired limit 12.0 GB" in line


def test_cuda_keeps_the_wired_limit_alone(as_gpu, monkeypatch):
    calls = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "NVIDIA H200", "total_memory": 141e9})
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 0)
    assert "NVIDIA H200 (base in its storage dtype" in precision.configure_device() and calls == []
