"""The fast CPU kernels (runtime/kernels.py) and the memory-bounded attention (models/attention.py)."""

import mlx.core as mx
import numpy as np
import pytest

from sa3mlx.models.attention import attention
from sa3mlx.runtime import kernels

BOTH_PATHS = pytest.mark.parametrize("fast", ["1", "0"], ids=["fast", "mlx"])


def _grad(fn, *arrays):
    weights = mx.random.normal(fn(*arrays).shape, key=mx.random.key(7))
    grads = mx.grad(lambda *a: (fn(*a) * weights).sum(), argnums=tuple(range(len(arrays))))(*arrays)
    return grads if isinstance(grads, tuple) else (grads,)


def test_switch_selects_the_path(monkeypatch):
    x = mx.zeros((2,))
    monkeypatch.setenv(kernels.SWITCH, "1")
    assert kernels.fast_path(x) and not kernels.fast_path(x.astype(mx.float16))
    monkeypatch.setenv(kernels.SWITCH, "0")
    assert not kernels.fast_path(x)
    y = mx.random.normal((64, 33), key=mx.random.key(0))
    assert mx.array_equal(kernels.sigmoid(y), mx.sigmoid(y))
    assert mx.array_equal(kernels.softmax(y), mx.softmax(y, axis=-1, precise=True))


def test_exp_is_fp32_accurate_over_the_whole_range():
    x = np.concatenate([np.linspace(-87.3, 88.3, 400_001, dtype=np.float32), np.float32([0.0, -1e-30, 1e-30])])
    got = np.array(kernels.exp(mx.array(x)))
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 1.5e-7
    edges = np.array(kernels.exp(mx.array([-88.0, -1e4, -np.inf, 89.0, np.inf, np.nan], dtype=mx.float32)))
    assert edges[:3].tolist() == [0.0, 0.0, 0.0] and np.isposinf(edges[3:5]).all() and np.isnan(edges[5])


@pytest.mark.parametrize(
    "name, reference",
    [
        ("softmax", lambda x: mx.softmax(x, axis=-1, precise=True)),
        ("sigmoid", mx.sigmoid),
        ("silu", lambda x: x * mx.sigmoid(x)),
        ("exp", mx.exp),
    ],
)
def test_fast_kernels_match_mlx_values_and_gradients(name, reference):
    x = 6 * mx.random.normal((8, 40, 97), key=mx.random.key(1))
    fast = getattr(kernels, name)
    assert kernels.fast_path(x)
    scale = mx.abs(reference(x)).max().item()
    assert mx.abs(fast(x) - reference(x)).max().item() <= 1e-6 * scale
    (got,), (want,) = _grad(fast, x), _grad(reference, x)
    assert mx.abs(got - want).max().item() <= 2e-6 * mx.abs(want).max().item()


def test_softmax_along_another_axis():
    x = mx.random.normal((5, 7, 3), key=mx.random.key(2))
    want = mx.softmax(x, axis=1, precise=True)
    assert mx.abs(kernels.softmax(x, axis=1) - want).max().item() < 1e-7


def test_fast_attention_matches_mlx_sdpa():
    q, k, v = (mx.random.normal((2, 3, 70, 16), key=mx.random.key(i)) for i in range(3))
    mask = mx.random.uniform(shape=(2, 1, 70, 70), key=mx.random.key(3)) > 0.3
    for m in (None, mask):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
        assert mx.abs(attention(q, k, v, 0.25, m) - want).max().item() < 1e-6


@BOTH_PATHS
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_chunked_attention_equals_whole_forward_and_gradient(monkeypatch, fast, masked):
    monkeypatch.setenv(kernels.SWITCH, fast)
    B, H, L, D = 1, 2, 1500, 16
    q, k, v = (mx.random.normal((B, H, L, D), key=mx.random.key(10 + i)) for i in range(3))
    mask = (mx.random.uniform(shape=(B, 1, L, L), key=mx.random.key(4)) > 0.2) if masked else None
    chunk_bytes = 4 * B * H * L * 256  # 256 query rows per chunk: 6 chunks, the last one short

    def whole(*a):
        return attention(*a, 0.25, mask)

    def chunked(*a):
        return attention(*a, 0.25, mask, chunk_bytes=chunk_bytes)

    assert mx.abs(chunked(q, k, v) - whole(q, k, v)).max().item() <= 1e-6
    for got, want in zip(_grad(chunked, q, k, v), _grad(whole, q, k, v)):
        assert mx.abs(got - want).max().item() <= 1e-6 * max(1.0, mx.abs(want).max().item())


def test_chunked_attention_bounds_the_backward_memory():
    B, H, L, D = 1, 4, 2048, 16  # whole scores: 64 MiB
    q, k, v = (mx.random.normal((B, H, L, D), key=mx.random.key(20 + i)) for i in range(3))
    mx.eval(q, k, v)

    def peak(chunk_bytes):
        mx.clear_cache()
        mx.reset_peak_memory()
        mx.eval(_grad(lambda *a: attention(*a, 0.25, chunk_bytes=chunk_bytes), q, k, v))
        return mx.get_peak_memory()

    whole_scores = 4 * B * H * L * L
    assert peak(whole_scores // 16) < 0.5 * peak(whole_scores)
