"""The fast CPU kernels (runtime/kernels.py) and the memory-bounded attention (models/attention.py)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES

from sa3mlx.models.attention import attention
from sa3mlx.parity.dit import load_fixture_dit
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.run import check
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


def test_large_arrays_use_mlx_kernels(monkeypatch):
    x = mx.random.normal((4, 50, 50), key=mx.random.key(5))
    monkeypatch.setattr(kernels, "FAST_MAX_BYTES", x.nbytes - 1)
    assert mx.array_equal(kernels.softmax(x), mx.softmax(x, axis=-1, precise=True))
    assert mx.array_equal(kernels.sigmoid(x), mx.sigmoid(x))
    monkeypatch.setattr(kernels, "FAST_MAX_BYTES", x.nbytes)
    assert not mx.array_equal(kernels.softmax(x), mx.softmax(x, axis=-1, precise=True))


def test_exp_is_fp32_accurate_over_the_whole_range():
    x = np.concatenate([np.linspace(-87.3, 88.3, 400_001, dtype=np.float32), np.float32([0.0, -1e-30, 1e-30])])
    got = np.array(kernels.exp(mx.array(x)))
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 1.5e-7
    edges = np.array(kernels.exp(mx.array([-88.0, -1e4, -np.inf, 89.0, np.inf, np.nan], dtype=mx.float32)))
    assert edges[:3].tolist() == [0.0, 0.0, 0.0] and np.isposinf(edges[3:5]).all() and np.isnan(edges[5])


def test_sigmoid_and_silu_are_fp32_accurate_in_their_tails():
    x = np.linspace(-41, 41, 200_001, dtype=np.float32)
    exact = 1 / (1 + np.exp(-x.astype(np.float64)))
    assert np.max(np.abs(np.array(kernels.sigmoid(mx.array(x))) - exact) / exact) < 2.5e-7
    assert np.max(np.abs(np.array(kernels.silu(mx.array(x))) - x * exact) / np.maximum(np.abs(x * exact), 1e-30)) < 3e-7
    far = np.array(kernels.sigmoid(mx.array([-1e4, -60.0, 60.0, 1e4, -np.inf, np.inf], dtype=mx.float32)))
    assert far.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]


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
    B, H, L, D = 1, 1, 1400, 16  # whole scores 7.5 MiB: the fast kernels take both forms
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


def test_chunked_attention_keeps_no_whole_score_tensor(monkeypatch):
    """The chunked backward recomputes each chunk's probabilities in turn: its peak is about the
    forward's (a few chunks in flight), far below the whole form's."""
    monkeypatch.setenv(kernels.SWITCH, "0")  # chunks of CHUNK_BYTES are always above FAST_MAX_BYTES
    B, H, L, D = 1, 4, 2048, 16  # whole scores: 64 MiB
    q, k, v = (mx.random.normal((B, H, L, D), key=mx.random.key(20 + i)) for i in range(3))
    mx.eval(q, k, v)

    def peak(compute):
        mx.clear_cache()
        mx.reset_peak_memory()
        mx.eval(compute())
        return mx.get_peak_memory()

    def grads(chunk_bytes):
        return lambda: _grad(lambda *a: attention(*a, 0.25, chunk_bytes=chunk_bytes), q, k, v)

    whole_scores = 4 * B * H * L * L
    chunk = whole_scores // 64
    forward = peak(lambda: attention(q, k, v, 0.25, chunk_bytes=chunk))
    backward = peak(grads(chunk))
    assert backward < 0.4 * whole_scores < 0.15 * peak(grads(whole_scores))
    assert backward < 2 * forward


@pytest.mark.parametrize("kind, folder", [("dit", "dit_medium"), ("same", "same"), ("train_step", "train_step")])
def test_parity_holds_on_the_plain_mlx_path(monkeypatch, kind, folder):
    """The parity tests run the fast path (the CPU default); these the MLX kernels it replaces."""
    monkeypatch.setenv(kernels.SWITCH, "0")
    report = check(kind, FIXTURES / folder)
    assert report.ok and not report.missing


def test_the_dit_runs_through_the_fast_kernels(monkeypatch):
    calls = []
    for name in ("_fast_softmax", "_fast_sigmoid"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda x, f=original, n=name: calls.append(n) or f(x))
    dit, _ = load_fixture_dit(Fixture(FIXTURES / "dit_medium"), "expected.npz")
    inputs = np.load(FIXTURES / "dit_medium" / "inputs.npz")
    mx.eval(dit(*[mx.array(inputs[k]) for k in ("x", "t", "cross_attn_cond", "global_cond", "local_add_cond")]))
    depth, pairs = dit.config.depth, 2  # differential: two softmaxes per attention
    assert calls.count("_fast_softmax") == 2 * pairs * depth  # self and cross
    assert calls.count("_fast_sigmoid") == 4 * depth  # SwiGLU and local-embed SiLU, the two gates
