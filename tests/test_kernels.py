"""The fast CPU kernels (runtime/kernels.py, runtime/native.py) and the memory-bounded attention
(models/attention.py)."""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import FIXTURES, ROOT, evaluated_with_peak

from sa3mlx.models.attention import attention
from sa3mlx.models.dit_layers import RotaryEmbedding, apply_rope
from sa3mlx.parity.dit import load_fixture_dit
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.run import check
from sa3mlx.runtime import kernels, native

FAST_PATHS = pytest.mark.parametrize("path", [kernels.NATIVE, kernels.COMPILED])
ALL_PATHS = pytest.mark.parametrize("path", [kernels.NATIVE, kernels.COMPILED, kernels.MLX])


def use(monkeypatch, path: str) -> None:
    """Select a kernel path; the native one must load wherever it is supported (skipped elsewhere)."""
    for name, value in kernels.ENVIRONMENT[path].items():
        monkeypatch.setenv(name, value)
    if path == kernels.NATIVE:
        if not native.supported():
            pytest.skip("native kernels: this CPU has no AVX2/FMA")
        assert native.load() is not None, "the native kernels are supported here but did not build or load"
    assert kernels.kernel_path(mx.zeros((2,))) == path


def _grad(fn, *arrays):
    weights = mx.random.normal(fn(*arrays).shape, key=mx.random.key(7))
    grads = mx.grad(lambda *a: (fn(*a) * weights).sum(), argnums=tuple(range(len(arrays))))(*arrays)
    return grads if isinstance(grads, tuple) else (grads,)


@ALL_PATHS
def test_switch_selects_the_path(monkeypatch, path):
    use(monkeypatch, path)
    assert kernels.kernel_path(mx.zeros((2,), mx.float16)) == kernels.MLX
    y = mx.random.normal((64, 34), key=mx.random.key(0))
    same = mx.array_equal(kernels.softmax(y), mx.softmax(y, axis=-1, precise=True))
    assert same == (path == kernels.MLX)
    assert mx.array_equal(kernels.sigmoid(y), mx.sigmoid(y)) == (path == kernels.MLX)


def test_large_arrays_use_mlx_kernels_on_the_compiled_path(monkeypatch):
    use(monkeypatch, kernels.COMPILED)
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


@FAST_PATHS
def test_sigmoid_and_silu_are_fp32_accurate_in_their_tails(monkeypatch, path):
    use(monkeypatch, path)
    x = np.linspace(-41, 41, 200_001, dtype=np.float32)
    exact = 1 / (1 + np.exp(-x.astype(np.float64)))
    assert np.max(np.abs(np.array(kernels.sigmoid(mx.array(x))) - exact) / exact) < 2.5e-7
    assert np.max(np.abs(np.array(kernels.silu(mx.array(x))) - x * exact) / np.maximum(np.abs(x * exact), 1e-30)) < 3e-7
    far = np.array(kernels.sigmoid(mx.array([-1e4, -60.0, 60.0, 1e4, -np.inf, np.inf], dtype=mx.float32)))
    # e^-60 is kept by the native exp (normal floats down to EXP_LO); the compiled one flushes below NEG_LO
    tiny = np.float32(np.exp(-60.0)) if path == kernels.NATIVE else 0.0
    assert far[[0, 2, 3, 4, 5]].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0] and np.isclose(far[1], tiny, rtol=1e-6, atol=0)


def _swiglu_reference(h):
    value, gate = mx.split(h, 2, axis=-1)
    return value * (gate * mx.sigmoid(gate))


@FAST_PATHS
@pytest.mark.parametrize(
    "name, reference",
    [
        ("softmax", lambda x: mx.softmax(x, axis=-1, precise=True)),
        ("sigmoid", mx.sigmoid),
        ("silu", lambda x: x * mx.sigmoid(x)),
        ("swiglu", _swiglu_reference),
        ("gelu_approx", nn.gelu_approx),
        ("exp", mx.exp),
    ],
)
def test_fast_kernels_match_mlx_values_and_gradients(monkeypatch, path, name, reference):
    use(monkeypatch, path)
    x = 6 * mx.random.normal((8, 40, 97), key=mx.random.key(1))
    x = x[..., :96] if name == "swiglu" else x  # halves of an even axis
    fast = getattr(kernels, name)
    scale = mx.abs(reference(x)).max().item()
    assert mx.abs(fast(x) - reference(x)).max().item() <= 1e-6 * scale
    (got,), (want,) = _grad(fast, x), _grad(reference, x)
    assert mx.abs(got - want).max().item() <= 2e-6 * mx.abs(want).max().item()


@ALL_PATHS
@pytest.mark.parametrize("layout", ["rows", "heads", "transposed"])
def test_rms_norm_matches_mlx_values_and_gradients(monkeypatch, path, layout):
    """Also on a head-transposed view ([B,L,H,D] -> [B,H,L,D]), which the native kernel reads in place, and
    on a last axis that is strided only once evaluated (as a matmul gradient's transposed view)."""
    use(monkeypatch, path)
    x = 3 * mx.random.normal((2, 37, 5, 24), key=mx.random.key(11)) + 0.5
    x = {"rows": x.reshape(2, 37, 120), "heads": x.transpose(0, 2, 1, 3), "transposed": x.swapaxes(-1, -2)}[layout]
    weight = mx.random.normal((x.shape[-1],), key=mx.random.key(12))
    reference = lambda a, w: mx.fast.rms_norm(a, w, 1e-6)  # noqa: E731
    fast = lambda a, w: kernels.rms_norm(a, w, 1e-6)  # noqa: E731
    want, got = reference(x, weight), fast(x, weight)
    assert mx.abs(got - want).max().item() <= 1e-6 * mx.abs(want).max().item()
    cotangent = mx.random.normal(x.shape[:-2] + x.shape[:-3:-1], key=mx.random.key(13)).swapaxes(-1, -2)  # lazy view
    (d_got,), (d_want,) = (
        mx.vjp(lambda a: fast(a, weight), [x], [cotangent])[1],
        mx.vjp(lambda a: reference(a, weight), [x], [cotangent])[1],
    )
    assert mx.abs(d_got - d_want).max().item() <= 2e-6 * mx.abs(d_want).max().item()
    for g, r in zip(_grad(fast, x, weight), _grad(reference, x, weight)):
        assert mx.abs(g - r).max().item() <= 2e-6 * mx.abs(r).max().item()


@pytest.mark.parametrize("layout", ["rows", "heads", "transposed"])
@pytest.mark.parametrize("rot", [8, 24])
def test_native_rope_is_the_mlx_formula_bit_for_bit(monkeypatch, layout, rot):
    """Forward and backward, on a part (8 of 24 dims) or all of the head dims, on contiguous rows, a
    head-transposed view read in place and a last axis that is strided once evaluated."""
    use(monkeypatch, kernels.NATIVE)
    x = mx.random.normal((2, 37, 5, 24), key=mx.random.key(14))
    x = {"rows": x.reshape(2, 5, 37, 24), "heads": x.transpose(0, 2, 1, 3), "transposed": x.swapaxes(-1, -3)}[layout]
    cos, sin = RotaryEmbedding(rot).tables(x.shape[-2])
    cotangent = mx.random.normal(x.shape, key=mx.random.key(15))
    assert kernels.native_rope(x, cos, sin)
    got = mx.vjp(lambda a: apply_rope(a, cos, sin), [x], [cotangent])
    monkeypatch.setattr(kernels, "native_rope", lambda *a: False)  # apply_rope's own MLX formula
    want = mx.vjp(lambda a: apply_rope(a, cos, sin), [x], [cotangent])
    for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert np.array(g).tobytes() == np.array(w).tobytes()


@FAST_PATHS
def test_compiled_steps_take_the_same_path(monkeypatch, path):
    """Under mx.compile (the train step) the kernels give the eager values and gradients bit for bit."""
    use(monkeypatch, path)
    h = 3 * mx.random.normal((2, 30, 2 * 45), key=mx.random.key(8))

    def loss(h):
        attn = kernels.softmax(h @ h.swapaxes(-1, -2) / 30.0)
        normed = kernels.rms_norm(h, mx.arange(90, dtype=mx.float32) / 45.0, 1e-6)
        return (attn @ kernels.swiglu(h)).sum() + kernels.sigmoid(h).sum() + (normed * normed).sum()

    eager = mx.value_and_grad(loss)(h)
    compiled = mx.compile(mx.value_and_grad(loss))(h)
    assert all(mx.array_equal(a, b) for a, b in zip(eager, compiled))


@FAST_PATHS
def test_softmax_along_another_axis(monkeypatch, path):
    use(monkeypatch, path)
    x = mx.random.normal((5, 7, 3), key=mx.random.key(2))
    want = mx.softmax(x, axis=1, precise=True)
    assert mx.abs(kernels.softmax(x, axis=1) - want).max().item() < 1e-7


@FAST_PATHS
def test_fast_attention_matches_mlx_sdpa(monkeypatch, path):
    use(monkeypatch, path)
    q, k, v = (mx.random.normal((2, 3, 70, 16), key=mx.random.key(i)) for i in range(3))
    mask = mx.random.uniform(shape=(2, 1, 70, 70), key=mx.random.key(3)) > 0.3
    for m in (None, mask):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
        assert mx.abs(attention(q, k, v, 0.25, m) - want).max().item() < 1e-6


@ALL_PATHS
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_chunked_attention_equals_whole_forward_and_gradient(monkeypatch, path, masked):
    use(monkeypatch, path)
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


@pytest.mark.parametrize("path", [kernels.NATIVE, kernels.MLX])  # chunks are above the compiled path's sizes
def test_chunked_attention_keeps_no_whole_score_tensor(monkeypatch, path):
    """The chunked backward recomputes each chunk's probabilities in turn: its peak is about the
    forward's (a few chunks in flight), far below the whole form's."""
    use(monkeypatch, path)
    B, H, L, D = 1, 4, 2048, 16  # whole scores: 64 MiB
    q, k, v = (mx.random.normal((B, H, L, D), key=mx.random.key(20 + i)) for i in range(3))
    mx.eval(q, k, v)

    def peak(compute):
        return evaluated_with_peak(compute)[1]

    def grads(chunk_bytes):
        return lambda: _grad(lambda *a: attention(*a, 0.25, chunk_bytes=chunk_bytes), q, k, v)

    whole_scores = 4 * B * H * L * L
    chunk = whole_scores // 64
    forward = peak(lambda: attention(q, k, v, 0.25, chunk_bytes=chunk))
    backward = peak(grads(chunk))
    assert backward < 0.4 * whole_scores < 0.15 * peak(grads(whole_scores))
    assert backward < 2 * forward


@pytest.mark.parametrize("path", [kernels.COMPILED, kernels.MLX])
@pytest.mark.parametrize("kind, folder", [("dit", "dit_medium"), ("same", "same"), ("train_step", "train_step")])
def test_parity_holds_on_the_other_paths(monkeypatch, path, kind, folder):
    """The parity tests run the CPU default (native where it builds); these the paths it replaces."""
    use(monkeypatch, path)
    report = check(kind, FIXTURES / folder)
    assert report.ok and not report.missing


@FAST_PATHS
def test_the_dit_runs_through_the_fast_kernels(monkeypatch, path):
    use(monkeypatch, path)
    norms, ropes = [], []
    rms_norm, native_rope = kernels.rms_norm, kernels._native_rope
    monkeypatch.setattr(kernels, "_native_rope", lambda x, c, s: ropes.append(x.shape) or native_rope(x, c, s))
    monkeypatch.setattr(
        kernels, "rms_norm", lambda x, w, eps: norms.append(kernels.kernel_path(x)) or rms_norm(x, w, eps)
    )
    names = {
        kernels.NATIVE: ("_native_softmax", "_native_sigmoid", "_native_swiglu"),
        kernels.COMPILED: ("_fast_softmax", "_fast_sigmoid"),
    }[path]
    calls = []
    for name in names:
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda x, f=original, n=name: calls.append(n) or f(x))
    monkeypatch.setattr(kernels, "_SOFTMAX", {path: getattr(kernels, names[0])})
    monkeypatch.setattr(kernels, "_SIGMOID", {path: getattr(kernels, names[1])})
    dit, _ = load_fixture_dit(Fixture(FIXTURES / "dit_medium"), "expected.npz")
    inputs = np.load(FIXTURES / "dit_medium" / "inputs.npz")
    mx.eval(dit(*[mx.array(inputs[k]) for k in ("x", "t", "cross_attn_cond", "global_cond", "local_add_cond")]))
    depth, pairs = dit.config.depth, 2  # differential: two softmaxes per attention
    assert calls.count(names[0]) == 2 * pairs * depth  # self and cross
    if path == kernels.NATIVE:  # SwiGLU fused; the local-embed SiLU and the two gates' sigmoids
        assert calls.count("_native_swiglu") == depth and calls.count("_native_sigmoid") == 3 * depth
    else:  # SwiGLU and local-embed SiLU, the two gates
        assert calls.count("_fast_sigmoid") == 4 * depth
    assert norms == [path] * (3 + 2 * 2 * pairs) * depth  # 3 block norms; q and k norms of each pair, self and cross
    assert len(ropes) == (2 * pairs * depth if path == kernels.NATIVE else 0)  # self-attention q and k of each pair


def _native_run(code: str, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, **kernels.ENVIRONMENT[kernels.NATIVE], **env}
    return subprocess.run([sys.executable, "-c", code], env=environment, cwd=ROOT, capture_output=True, text=True)


RESULT_BYTES = """
import hashlib, sa3mlx, mlx.core as mx, numpy as np
from sa3mlx.runtime import kernels
assert kernels.kernel_path(mx.zeros(2)) == kernels.{path}
x = 8 * mx.random.normal((3, 16, 130, 301), key=mx.random.key(4))
g = mx.random.normal(x.shape, key=mx.random.key(5))
out = mx.vjp(lambda x: kernels.softmax(x) * kernels.sigmoid(x), [x], [g])
swiglu = mx.vjp(kernels.swiglu, [x[..., :300]], [g[..., :150]])
norm = mx.vjp(lambda x: kernels.rms_norm(x, mx.arange(301, dtype=mx.float32), 1e-6), [x], [g])
arrays = [*out[0], *out[1], *swiglu[0], *swiglu[1], *norm[0], *norm[1]]
if kernels.kernel_path(x) == kernels.NATIVE:
    tables = [mx.cos(x[0, 0, :, :200]), mx.sin(x[0, 1, :, :200])]
    arrays += [*mx.vjp(lambda x: kernels.rope(x, *tables), [x], [g])[1]]
    tensors = [x.reshape(-1)[:k * 40000].reshape(k, -1) for k in (1, 3, 7)]
    scalars = mx.array([0.5, 0.99, 1e-3, 3.0, 1.0])
    params, ms, vs, sums = kernels.adamw(scalars, tensors, tensors, tensors, tensors, (0.9, 0.95), 1e-8)
    arrays += [kernels.sum_squares(tensors), *params, *ms, *vs, sums]
print(hashlib.sha256(b"".join(np.array(a).tobytes() for a in arrays)).hexdigest())
"""


def test_native_results_do_not_depend_on_the_thread_count():
    if not native.supported():
        pytest.skip("native kernels: this CPU has no AVX2/FMA")
    code = RESULT_BYTES.format(path="NATIVE")
    runs = [_native_run(code, SA3MLX_KERNEL_THREADS=str(n)) for n in (1, 2, 3, 1)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert len({r.stdout for r in runs}) == 1


def test_a_failed_native_build_falls_back_with_one_warning(tmp_path):
    if not native.supported():
        pytest.skip("native kernels: this CPU has no AVX2/FMA")
    broken = {"XDG_CACHE_HOME": str(tmp_path), "CXX": "/bin/false"}
    first = _native_run(RESULT_BYTES.format(path="COMPILED"), **broken)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sa3mlx: warning: native CPU kernels unavailable (g++ failed")
    assert "using MLX-compiled kernels" in lines[0]
    assert not list(tmp_path.rglob("*.so"))
    # later processes do not retry it, nor say it again; the set-up command (./dev) retries and says it
    second = _native_run(RESULT_BYTES.format(path="COMPILED"), **broken)
    assert second.returncode == 0 and second.stderr == "" and second.stdout == first.stdout
    retry = _native_run("from sa3mlx.runtime import native; raise SystemExit(native.main(['--quiet']))", **broken)
    assert retry.returncode == 1 and retry.stdout == "" and len(retry.stderr.strip().splitlines()) == 1
    assert retry.stderr.strip() == lines[0]


def test_the_native_build_is_cached_per_key(tmp_path, monkeypatch):
    if not native.supported():
        pytest.skip("native kernels: this CPU has no AVX2/FMA")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = native.build()
    assert built.is_relative_to(tmp_path / "sa3mlx" / "native") and built.stat().st_size > 0
    stamp = built.stat().st_mtime_ns

    def no_compiling(out):
        raise AssertionError("rebuilt a cached extension")

    monkeypatch.setattr(native, "_command", no_compiling)
    assert native.build() == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir() if p.suffix == ".so"] == [built.name]  # no temporary left
