import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from sa3mlx.lora.layers import FROZEN_KEYS, LoRAConv1d, LoRALinear, build_adapters, wrap
from sa3mlx.lora.maths import NORM_EPS
from sa3mlx.lora.svd import canonical_svd
from sa3mlx.lora.types import ADAPTER_TYPES, AdapterTypeError, adapter_kind, resolve_adapter_type, squeeze_magnitudes

ALL_NAMES = ADAPTER_TYPES + ("dora", "dora-xs", "xs")


def _linear(seed=0, out=12, inp=8, bias=True):
    layer = nn.Linear(inp, out, bias=bias)
    rng = np.random.default_rng(seed)
    layer.weight = mx.array(rng.standard_normal((out, inp)).astype(np.float32) / math.sqrt(inp))
    if bias:
        layer.bias = mx.array(rng.standard_normal(out).astype(np.float32) * 0.1)
    return layer


def _conv(seed=0, out=10, inp=6, k=3):
    layer = nn.Conv1d(inp, out, k, padding=1, bias=True)
    layer.weight = mx.array(np.random.default_rng(seed).standard_normal((out, k, inp)).astype(np.float32) * 0.3)
    return layer


def _randomize(layer, seed=1):
    """Non-trivial adapter values (B != 0, M_xs != 0, magnitudes off their init)."""
    rng = np.random.default_rng(seed)
    for name, value in layer.lora_state().items():
        noise = rng.standard_normal(value.shape).astype(np.float32)
        layer[name] = value * (1 + 0.2 * mx.array(noise)) if name.startswith("magnitude") else mx.array(0.3 * noise)


def test_names_aliases_and_legacy_resolution():
    assert adapter_kind("dora").name == "dora-rows"
    assert adapter_kind("dora-xs").name == "dora-rows-xs"
    assert adapter_kind("xs").name == "lora-xs"
    with pytest.raises(AdapterTypeError, match="unknown adapter_type 'lorra'"):
        adapter_kind("lorra")
    key = "model.x.parametrizations.weight.0.magnitude"
    assert resolve_adapter_type("dora", {key: np.ones((1, 24))}) == "dora-cols"
    assert resolve_adapter_type("dora", {key: np.ones((40, 1))}) == "dora-rows"
    assert resolve_adapter_type("dora", {key: np.ones(40)}) == "dora-rows"
    assert resolve_adapter_type("dora") == "dora-rows"
    assert resolve_adapter_type("dora-cols", {key: np.ones((1, 24))}) == "dora-cols"
    assert squeeze_magnitudes({key: np.ones((1, 24))})[key].shape == (24,)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_init_is_identity_and_only_adapter_tensors_train(name):
    layer = wrap(_linear(), name, 4, key=mx.random.key(0))
    base = _linear()
    x = mx.random.normal((3, 8), key=mx.random.key(1))
    assert np.allclose(np.array(layer.effective_weight()), np.array(base.weight), atol=1e-6)
    assert np.allclose(np.array(layer(x)), np.array(base(x)), atol=1e-5)
    trainable = {k for k, _ in tree_flatten(layer.trainable_parameters())}
    kind = adapter_kind(name)
    assert trainable == set(kind.param_shapes(4, 12, 8))
    assert not trainable & set(FROZEN_KEYS)
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(layer.trainable_parameters()))


def test_official_initialisation():
    base = _linear(out=40, inp=24)
    layer = wrap(base, "bora", 4, key=mx.random.key(3))
    bound = 1 / math.sqrt(24)
    a = np.array(layer.lora_A)
    assert a.shape == (4, 24) and np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound
    assert not np.array(layer.lora_B).any()
    w = np.array(base.weight)
    assert np.allclose(np.array(layer.magnitude_r), np.linalg.norm(w, axis=1), rtol=1e-6)
    assert np.allclose(np.array(layer.magnitude_c), np.linalg.norm(w, axis=0), rtol=1e-6)
    xs = wrap(base, "lora-xs", 4)
    u, _, v = canonical_svd(w)
    assert np.array_equal(np.array(xs.U), u[:, :4]) and np.array_equal(np.array(xs.V), v[:, :4])
    assert not np.array(xs.M_xs).any()


def test_svd_signs_are_canonical_and_bases_orthonormal():
    w = np.random.default_rng(0).standard_normal((20, 9)).astype(np.float32)
    u, s, v = canonical_svd(w)
    peak = u[np.abs(u).argmax(axis=0), np.arange(u.shape[1])]
    assert (peak > 0).all()
    assert np.allclose(u.T @ u, np.eye(9), atol=1e-5) and np.allclose(v.T @ v, np.eye(9), atol=1e-5)
    assert np.allclose((u * s) @ v.T, w, atol=1e-5)
    u_neg, _, v_neg = canonical_svd(-w)  # the sign rule pins U; V carries the sign of W
    assert np.allclose(u_neg, u, atol=1e-5) and np.allclose(v_neg, -v, atol=1e-5)


@pytest.mark.parametrize("name", ["dora-rows", "dora-cols", "bora", "dora-rows-xs", "bora-xs"])
def test_directional_strength_semantics(name):
    layer = wrap(_linear(), name, 4, key=mx.random.key(0))
    _randomize(layer)
    w = np.array(layer.weight)
    layer.strength = 0.0
    assert np.array_equal(np.array(layer.effective_weight()), w)  # hard bypass
    layer.strength = 1e-9  # λ→0⁺: the magnitudes still apply fully
    kind = adapter_kind(name)
    near_zero = np.array(layer.effective_weight())
    if kind.norm == "rows":
        m = np.array(layer.magnitude)
        expected = m[:, None] * w / (np.linalg.norm(w, axis=1, keepdims=True) + NORM_EPS)
        assert np.allclose(near_zero, expected, atol=1e-5)
    assert not np.allclose(near_zero, w, atol=1e-3)


def test_plain_lora_strength_is_linear():
    layer = wrap(_linear(), "lora", 4, 8, key=mx.random.key(0))
    _randomize(layer)
    w = np.array(layer.weight)
    delta = 2.0 * np.array(layer.lora_B) @ np.array(layer.lora_A)
    for strength in (0.0, 0.5, 1.0):
        layer.strength = strength
        assert np.allclose(np.array(layer.effective_weight()), w + strength * delta, atol=1e-6)


@pytest.mark.parametrize("name", ADAPTER_TYPES)
@pytest.mark.parametrize("make", [_linear, _conv, lambda: _conv(k=1)])
def test_unmaterialized_form_equals_materialized(name, make):
    base = make()
    layer = wrap(base, name, 3, 6, key=mx.random.key(0))
    _randomize(layer)
    inp = base.weight.shape[-1]
    x = (
        mx.random.normal((2, 7, inp), key=mx.random.key(5))
        if isinstance(layer, LoRAConv1d)
        else mx.random.normal((2, 5, inp), key=mx.random.key(5))
    )
    for strength in (1.0, 0.5, 0.0):
        layer.strength = strength
        layer.materialize = True
        full = np.array(layer(x))
        layer.materialize = False
        assert np.allclose(np.array(layer(x)), full, atol=2e-5, rtol=1e-5), (name, strength)


def test_conv_uses_torch_in_major_flattening():
    base = _conv()
    layer = wrap(base, "lora", 2, key=mx.random.key(0))
    _randomize(layer)
    w_torch = np.array(base.weight).transpose(0, 2, 1)  # (out, in, k)
    delta = (np.array(layer.lora_B) @ np.array(layer.lora_A)).reshape(w_torch.shape)
    expected = w_torch + delta
    assert np.allclose(np.array(layer.effective_weight()).transpose(0, 2, 1), expected, atol=1e-6)


def test_fp16_base_keeps_fp32_adapter_and_norms_of_the_loaded_weight():
    """An fp16 base kept as stored computes in fp32 on the CPU: its magnitudes are those of the same
    weight cast to fp32 at load (train.base_dtype changes memory, not numbers)."""
    base = _linear()
    base.weight = base.weight.astype(mx.float16)
    layer = wrap(base, "dora-rows-xs", 4)
    assert layer.weight.dtype == mx.float16 and layer.magnitude.dtype == mx.float32
    w16 = np.array(base.weight).astype(np.float32)
    assert np.array_equal(np.array(layer.magnitude), np.array(mx.linalg.norm(mx.array(w16), axis=1)))
    assert np.array_equal(np.array(layer.U), canonical_svd(w16)[0][:, :4])
    y = layer(mx.ones((2, 8)))
    assert y.dtype == mx.float32  # CPU computes fp16 storage in fp32


def test_gradients_reach_adapter_tensors_only():
    layer = wrap(_linear(), "bora", 4, key=mx.random.key(0))
    x = mx.random.normal((4, 8), key=mx.random.key(2))

    def loss(params):
        layer.update(params)
        return mx.sum(layer(x) ** 2)

    grads = dict(tree_flatten(mx.grad(loss)(layer.trainable_parameters())))
    assert set(grads) == {"lora_A", "lora_B", "magnitude_r", "magnitude_c"}
    assert float(mx.abs(grads["lora_B"]).sum()) > 0


def test_build_adapters_is_deterministic_per_seed():
    bases = {"model.a": _linear(0), "model.b": _conv(1)}
    one = build_adapters(bases, "lora", 4, seed=7)
    two = build_adapters(bases, "lora", 4, seed=7)
    other = build_adapters(bases, "lora", 4, seed=8)
    assert isinstance(one["model.a"], LoRALinear) and isinstance(one["model.b"], LoRAConv1d)
    assert np.array_equal(np.array(one["model.b"].lora_A), np.array(two["model.b"].lora_A))
    assert not np.array_equal(np.array(one["model.b"].lora_A), np.array(other["model.b"].lora_A))
    assert not np.array_equal(np.array(one["model.a"].lora_A)[:, :4], np.array(one["model.b"].lora_A)[:, :4])
    with pytest.raises(TypeError, match="cannot adapt a Embedding"):
        wrap(nn.Embedding(4, 4), "lora", 2)


@pytest.mark.parametrize("name", ["lora", "dora-rows", "dora-cols", "bora", "bora-xs"])
def test_unmaterialized_gradients_equal_materialized(name):
    layer = wrap(_linear(), name, 3, key=mx.random.key(0))
    _randomize(layer)
    x = mx.random.normal((6, 8), key=mx.random.key(4))

    def grads(materialize):
        layer.materialize = materialize

        def loss(params):
            layer.update(params)
            return mx.sum(mx.sin(layer(x)))

        return dict(tree_flatten(mx.grad(loss)(layer.trainable_parameters())))

    full, fast = grads(True), grads(False)
    for key in full:
        assert np.allclose(np.array(fast[key]), np.array(full[key]), atol=1e-4, rtol=1e-4), key


@pytest.mark.parametrize("name", ["dora-rows", "dora-rows-xs"])
def test_the_stacked_matmul_gives_the_separate_products(monkeypatch, name):
    """dora-rows takes x·Wᵀ and W·Rᵀ from one matmul (`LoRALinear.apply_stacked`): the layer's output
    and its gradients are those of the two matmuls apart."""
    base = nn.Linear(48, 40, bias=True)
    layer = wrap(base, name, 4, key=mx.random.key(3), materialize=False)
    layer.update(
        {k: v + 0.1 * mx.random.normal(v.shape, key=mx.random.key(9)) for k, v in layer.adapter_tensors().items()}
    )
    x = mx.random.normal((2, 7, 48), key=mx.random.key(4))
    names = sorted(layer.adapter_tensors())

    def value_and_grads():
        def loss(x, *tensors):
            layer.update(dict(zip(names, tensors)))
            return (layer(x) ** 2).sum()

        tensors = [layer.adapter_tensors()[n] for n in names]
        return mx.value_and_grad(loss, argnums=tuple(range(len(names) + 1)))(x, *tensors)

    assert layer.stacks(x, base.weight)
    stacked_loss, stacked = value_and_grads()
    monkeypatch.setattr(LoRALinear, "stacks", lambda self, x, w: False)
    separate_loss, separate = value_and_grads()
    assert abs(stacked_loss.item() - separate_loss.item()) <= 1e-6 * abs(separate_loss.item())
    for got, want in zip(stacked, separate):
        assert mx.abs(got - want).max().item() <= 1e-6 * mx.abs(want).max().item()
