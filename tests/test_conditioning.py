import mlx.core as mx
import numpy as np
from conftest import FIXTURES

from sa3mlx.models.conditioning import (
    Conditioner,
    local_conditioning,
    negative_tokens,
    text_to_audio_local,
    unconditional_tokens,
)
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check

# this keys; the prompt keys need the T5Gemma encoder
SECONDS_KEYS = {
    "seconds_clamped_normalized",
    "seconds_fourier_features",
    "seconds_expo_freqs",
    "seconds_embedding",
    "apply_padding_out",
    "global_cond",
    "cross_attn_mask",
}


def test_conditioner_parity():
    report = check("conditioner", FIXTURES / "conditioner")
    print("\n".join(report.lines()))
    assert report.ok
    computed = {c.key: c for _, c in report.rows}
    assert SECONDS_KEYS <= computed.keys()
    assert all(c.psnr_db >= THRESHOLDS_DB["conditioner"] for c in computed.values())


def _conditioner(dim: int = 4) -> Conditioner:
    cond = Conditioner(cond_dim=dim)
    cond.padding_embedding = mx.arange(dim, dtype=mx.float32) + 100
    cond.seconds_total_weight = mx.ones((dim, 256)) / 256
    return cond


def test_padding_rows_are_replaced_and_assembly_order():
    cond = _conditioner()
    hidden = mx.random.normal((2, 3, 4))
    mask = mx.array([[1, 1, 0], [0, 1, 1]])
    inputs = cond.assemble(hidden, mask, [5.0, 500.0])
    cross = np.array(inputs.cross_attn_cond)
    assert cross.shape == (2, 4, 4)
    assert np.array_equal(cross[0, 2], np.arange(4) + 100) and np.array_equal(cross[1, 0], np.arange(4) + 100)
    assert np.array_equal(cross[0, :2], np.array(hidden)[0, :2])
    assert np.array_equal(cross[:, -1], np.array(inputs.global_cond))  # seconds token last, = global cond
    assert np.array_equal(np.array(inputs.cross_attn_mask), [[1, 1, 0, 1], [0, 1, 1, 1]])
    assert np.array(cond.normalized_seconds([-3.0, 192.0, 500.0])).tolist() == [0.0, 0.5, 1.0]


def test_unconditional_and_negative_tokens():
    cross = mx.random.normal((1, 3, 4))
    assert not np.array(unconditional_tokens(cross)).any()
    neg = np.array(negative_tokens(cross, mx.array([[1.0, 0.0, 1.0]])))
    assert not neg[0, 1].any() and np.array_equal(neg[0, [0, 2]], np.array(cross)[0, [0, 2]])


def test_local_conditioning_layout():
    latents = mx.random.normal((2, 3, 5))
    keep = mx.array([[1, 1, 0, 0, 1], [0, 0, 0, 0, 0]])
    local = np.array(local_conditioning(keep, latents))
    assert local.shape == (2, 4, 5)
    assert np.array_equal(local[:, 0], np.array(keep, dtype=np.float32))
    assert np.array_equal(local[:, 1:], np.array(latents) * np.array(keep)[:, None, :])
    assert not np.array(text_to_audio_local(2, 3, 5)).any()
