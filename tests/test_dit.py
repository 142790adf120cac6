import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, ROOT
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from sa3mlx.convert.model import convert_source
from sa3mlx.models.conditioning import load_dit
from sa3mlx.models.config import DiTConfig
from sa3mlx.models.dit import DiT, compiled_forward
from sa3mlx.models.fourier import TORCH_FREQS_256, expo_frequencies
from sa3mlx.parity.dit import load_fixture_dit
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check


@pytest.mark.parametrize("folder", ["dit_small", "dit_medium"])
def test_dit_parity(folder):
    report = check("dit", FIXTURES / folder)
    print("\n".join(report.lines()))
    assert report.ok and not report.missing
    assert all(c.psnr_db >= THRESHOLDS_DB["dit"] for _, c in report.rows)


def test_embedded_frequencies_equal_both_fixture_copies_bit_for_bit():
    copies = [
        np.load(FIXTURES / "dit_small" / "intermediates.npz")["expo_freqs"],
        np.load(FIXTURES / "conditioner" / "expected.npz")["seconds_expo_freqs"],
    ]
    for stored in copies:
        assert stored.dtype == np.float32
        assert np.array_equal(stored.view(np.uint32), TORCH_FREQS_256.view(np.uint32))
    assert np.array_equal(expo_frequencies(256).view(np.uint32), TORCH_FREQS_256.view(np.uint32))
    other = expo_frequencies(64)  # computed, close to the exact maths
    exact = np.exp(np.linspace(np.log(0.5), np.log(1e4), 32))
    assert other.dtype == np.float32 and np.allclose(other, exact, rtol=1e-6)


def _random_tiny_dit(differential: bool) -> DiT:
    cfg = DiTConfig(
        io_channels=4,
        embed_dim=64,
        depth=2,
        num_heads=1,
        cond_token_dim=16,
        global_cond_dim=16,
        local_add_cond_dim=5,
        num_memory_tokens=2,
        timestep_features_dim=256,
        ff_inner=96,
        differential=differential,
    )
    mx.random.seed(0)
    dit = DiT(cfg)
    # every trainable tensor random (the official init zeroes several), fan-in scaled
    dit.update(
        tree_map(
            lambda p: mx.random.normal(p.shape) / (p.shape[-1] ** 0.5 if p.ndim > 1 else 4.0),
            dit.trainable_parameters(),
        )
    )
    return dit


def _five_point(f, h: float) -> float:
    return (-f(2 * h) + 8 * f(h) - 8 * f(-h) + f(-2 * h)) / (12 * h)


@pytest.mark.parametrize("differential", [False, True])
def test_gradients_match_central_differences(differential):
    dit = _random_tiny_dit(differential)
    B, T = 2, 6
    x, w = mx.random.normal((B, 4, T)), mx.random.normal((B, 4, T))
    t, cross = mx.array([0.3, 0.8]), mx.random.normal((B, 3, 16))
    glob, local = mx.random.normal((B, 16)), mx.random.normal((B, 5, T))

    def loss_x(x_):
        return (dit(x_, t, cross, glob, local) * w).sum()

    direction = mx.random.normal(x.shape)
    analytic = (mx.grad(loss_x)(x) * direction).sum().item()
    numeric = _five_point(lambda s: loss_x(x + s * direction).item(), 3e-2)
    assert numeric == pytest.approx(analytic, rel=1e-3)

    params = dict(tree_flatten(dit.trainable_parameters()))

    def loss_p(flat):
        dit.update(tree_unflatten(list(flat.items())))
        return loss_x(x)

    grads = mx.grad(loss_p)(params)
    for name, g in grads.items():
        norm = mx.sqrt((g * g).sum()).item()
        assert norm > 0, name
        unit = g / norm  # slope along the gradient direction must equal its norm
        numeric = _five_point(lambda s: loss_p({**params, name: params[name] + s * unit}).item(), 3e-2)
        assert numeric == pytest.approx(norm, rel=2e-2), name


def test_compiled_forward_equals_eager():
    dit, _ = load_fixture_dit(Fixture(FIXTURES / "dit_small"), "expected.npz")
    inputs = np.load(FIXTURES / "dit_small" / "inputs.npz")
    args = [mx.array(inputs[k]) for k in ("x", "t", "cross_attn_cond", "global_cond", "local_add_cond")]
    compiled = compiled_forward(dit)
    assert np.allclose(np.array(compiled(*args)), np.array(dit(*args)), atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-base", "tiny-arc"])
def test_converted_tiny_models_load_strictly_and_run(tmp_path, name):
    convert_source(ROOT / "models" / name, tmp_path)
    dit, cond = load_dit(tmp_path / "dit.npz")
    assert dit.dtype == mx.float32  # fp16 storage, fp32 compute on the CPU
    assert dit.transformer.rotary_pos_emb.inv_freq.dtype == mx.float32
    cfg = dit.config
    B, T = 2, 10
    prompt = mx.random.normal((B, 5, cfg.cond_token_dim))
    inputs = cond.assemble(
        prompt, mx.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), [10.0, 30.0], mx.zeros((B, cfg.io_channels + 1, T))
    )
    v = dit(
        mx.random.normal((B, cfg.io_channels, T)),
        mx.array([0.9, 0.4]),
        inputs.cross_attn_cond,
        inputs.global_cond,
        inputs.local_add_cond,
    )
    assert v.shape == (B, cfg.io_channels, T) and np.isfinite(np.array(v)).all()


def test_strict_loading_rejects_missing_and_extra_keys(tmp_path):
    convert_source(ROOT / "models" / "tiny-base", tmp_path)
    (tmp_path / "manifest.json").unlink()  # hand-made files, not a damaged converted folder (sha256 checked)
    arrays = dict(np.load(tmp_path / "dit.npz"))
    for broken, message in [
        ({k: v for k, v in arrays.items() if k != "transformer.layers.1.ff_norm.weight"}, "Missing"),
        ({**arrays, "transformer.layers.9.extra": arrays["cond.padding_embedding"]}, "not in model"),
        ({**arrays, "cond.unknown": arrays["cond.padding_embedding"]}, "not in model"),
    ]:
        np.savez(tmp_path / "dit.npz", **broken)
        with pytest.raises(ValueError, match=message):
            load_dit(tmp_path / "dit.npz")
