"""The training objective on small arrays with hand-computed expectations."""

import mlx.core as mx
import numpy as np
import pytest

from sa3mlx.train.objective import (
    COUNT_EPS,
    ObjectiveConfig,
    context_loss,
    draw_cfg_dropout,
    drop_cross_attention,
    local_add_cond,
    loss_masks,
    masked_loss,
    normalized_mse,
    objective_loss,
    random_inpaint_masks,
    rectified_flow,
)
from sa3mlx.train.presets import resolve


def arr(values, dtype=mx.float32):
    return mx.array(np.asarray(values), dtype=dtype)


def test_rectified_flow_noising_and_velocity_target():
    x0 = arr([[[1.0, 2.0]], [[4.0, -2.0]]])  # [2,1,2]
    noise = arr([[[3.0, 5.0]], [[0.0, 2.0]]])
    noised, target = rectified_flow(x0, noise, arr([0.25, 1.0]))
    assert np.array(noised).tolist() == [[[1.5, 2.75]], [[0.0, 2.0]]]
    assert np.array(target).tolist() == [[[2.0, 3.0]], [[-4.0, 4.0]]]


def test_cfg_dropout_zeroes_every_token_of_dropped_samples_only():
    cross = mx.ones((3, 4, 2))
    out = np.array(drop_cross_attention(cross, arr([True, False, True], mx.bool_)))
    assert out[0].sum() == 0 and out[2].sum() == 0 and (out[1] == 1).all()
    rng = np.random.default_rng(0)
    assert not draw_cfg_dropout(rng, 100, 0.0).any() and draw_cfg_dropout(rng, 100, 1.0).all()
    assert 0 < draw_cfg_dropout(rng, 1000, 0.1).mean() < 0.2


def test_local_conditioning_conventions():
    x0 = arr([[[2.0, 3.0, 4.0]]])  # [1,1,3]
    ones = np.array(local_add_cond(x0, None))
    assert ones.tolist() == [[[1, 1, 1], [0, 0, 0]]]  # underfit's loop: all-ones mask, zero context
    masked = np.array(local_add_cond(x0, arr([[[1.0, 0.0, 1.0]]])))
    assert masked.tolist() == [[[1, 0, 1], [2, 0, 4]]]


def test_loss_and_context_masks():
    padding = arr([[True, True, True, False]], mx.bool_)
    loss_mask, ctx = loss_masks(padding, arr([[[1.0, 0.0, 0.0, 1.0]]]))
    assert np.array(loss_mask).tolist() == [[False, True, True, False]]
    assert np.array(ctx).tolist() == [[True, False, False, False]]
    only, none = loss_masks(padding, None)
    assert np.array(only).tolist() == [[True, True, True, False]] and none is None


def test_masked_loss_per_sample_then_batch():
    mse = arr(
        [
            [[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]],  # sample 0, C = 2
            [[10.0, 0.0, 0.0], [20.0, 0.0, 0.0]],
        ]
    )
    mask = arr([[True, True, False], [True, False, False]], mx.bool_)
    loss, per = masked_loss(mse, mask, signal_only=True)
    # sample 0: (1+2+3+4)/4 = 2.5; sample 1: (10+20)/2 = 15; batch mean 8.75
    assert np.allclose(np.array(per), [2.5, 15.0]) and np.isclose(loss.item(), 8.75)
    loss_w, per_w = masked_loss(mse, mask, signal_only=False, padding_weight=0.5)
    # sample 0: (10 + 0.5·8) / (4 + 0.5·2) = 2.8; sample 1: (30 + 0) / (2 + 0.5·4) = 7.5
    assert np.allclose(np.array(per_w), [2.8, 7.5]) and np.isclose(loss_w.item(), 5.15)
    _, per_0 = masked_loss(mse, mask, signal_only=False, padding_weight=0.0)
    assert np.allclose(np.array(per_0), [2.5, 15.0])  # weight 0: the same as signal only
    empty, _ = masked_loss(mse, arr([[False] * 3, [False] * 3], mx.bool_), signal_only=True)
    assert empty.item() == 0.0  # no signal: 0 / 1e-8, not NaN
    assert COUNT_EPS == 1e-8


def test_context_loss_term():
    mse = arr([[[1.0, 5.0]], [[2.0, 7.0]]])  # [2,1,2]
    ctx = arr([[True, False], [False, False]], mx.bool_)
    # sample 0: 1/1; sample 1: no context -> 0; mean 0.5
    assert np.isclose(context_loss(mse, ctx).item(), 0.5)


def test_objective_loss_adds_weighted_context_term():
    pred, target = mx.zeros((1, 1, 4)), arr([[[1.0, 2.0, 3.0, 4.0]]])  # mse 1, 4, 9, 16
    padding = arr([[True, True, True, False]], mx.bool_)
    keep = arr([[[1.0, 0.0, 0.0, 0.0]]])
    cfg = ObjectiveConfig(loss_on_signal_only=True, context_loss_weight=2.0)
    loss, per = objective_loss(pred, target, padding, keep, cfg)
    # main term over frames 1-2: (4+9)/2 = 6.5; context term over frame 0: 1; 6.5 + 2·1
    assert np.isclose(per.item(), 6.5) and np.isclose(loss.item(), 8.5)
    ones_loss, _ = objective_loss(pred, target, padding, None, cfg)
    assert np.isclose(ones_loss.item(), (1 + 4 + 9) / 3)  # ones convention: the loss on the padding mask


def test_loss_normalization_modes():
    pred = mx.zeros((1, 2, 3))
    target = arr([[[1.0, 2.0, 6.0], [3.0, 2.0, 0.0]]])
    mse = np.array(target) ** 2
    mask = arr([[True, True, False]], mx.bool_)
    assert np.allclose(np.array(normalized_mse(pred, target, mask, "none")), mse)
    # timestep: channel variance per frame: frame 0 (1,3) -> 1, frame 1 (2,2) -> 0, frame 2 unused
    timestep = np.array(normalized_mse(pred, target, mask, "timestep", eps=0.5))
    assert np.allclose(timestep[0, :, 0], mse[0, :, 0] / 1.5) and np.allclose(timestep[0, :, 1], mse[0, :, 1] / 0.5)
    assert np.allclose(timestep[0, :, 2], mse[0, :, 2])  # outside the mask: raw
    # sample: masked values 1,2,3,2 -> mean 2, variance 0.5
    sample = np.array(normalized_mse(pred, target, mask, "sample", eps=0.0))
    assert np.allclose(sample[..., :2], mse[..., :2] / 0.5) and np.allclose(sample[..., 2], mse[..., 2])
    # sample_channel: channel 0 (1,2) -> 0.25; channel 1 (3,2) -> 0.25
    per_channel = np.array(normalized_mse(pred, target, mask, "sample_channel", eps=0.0))
    assert np.allclose(per_channel[..., :2], mse[..., :2] / 0.25)
    # a fully masked-out sample: divisor 1 (the official NaN -> 1), i.e. raw
    nothing = arr([[False, False, False]], mx.bool_)
    assert np.allclose(np.array(normalized_mse(pred, target, nothing, "sample")), mse)
    with pytest.raises(ValueError):
        normalized_mse(pred, target, mask, "bogus")


def test_random_inpaint_mask_types():
    rng = np.random.default_rng(0)
    padding = np.array([[True] * 6 + [False] * 2] * 4)
    full = random_inpaint_masks(rng, padding, [0, 1, 0], mask_padding=True)
    assert full.shape == (4, 1, 8) and full.dtype == np.float32 and not full.any()
    for mask_padding in (False, True):
        causal = random_inpaint_masks(rng, padding, [0, 0, 1], mask_padding=mask_padding)
        for row in causal[:, 0]:
            real = row[:6]
            assert np.all(np.diff(real) <= 0)  # a kept prefix, then generated frames
            assert (row[6:] == (0 if mask_padding else 1)).all()
        segments = random_inpaint_masks(rng, padding, [1, 0, 0], mask_padding=mask_padding)
        assert (segments[:, 0, :6] == 0).any(axis=1).all()  # at least one generated frame each
        assert (segments[:, 0, 6:] == (0 if mask_padding else 1)).all()
    empty = random_inpaint_masks(rng, np.zeros((1, 4), bool), [1, 0, 0], mask_padding=True)
    assert empty.all()  # no real frames: nothing to generate (official)
    again = [random_inpaint_masks(np.random.default_rng(5), padding, [0.2, 0.6, 0.2], True) for _ in range(2)]
    assert np.array_equal(*again)


def test_objective_from_presets():
    with pytest.raises(ValueError, match="mask_padding_attention is unresolved"):
        ObjectiveConfig.from_train_config(resolve("sa3-official"))
    official = ObjectiveConfig.from_train_config(resolve("sa3-official", {"mask_padding_attention": True}))
    assert official.dit_padding_mask and official.loss_on_signal_only and official.context_loss_weight == 1.0
    assert official.inpaint_mask_probabilities == (0.1, 0.8, 0.1)
    loop = ObjectiveConfig.from_train_config(resolve("underfit-loop", {"lr": 1e-4, "mask_padding_attention": False}))
    assert not loop.inpainting and not loop.dit_padding_mask and loop.cfg_dropout_prob == 0.1
    dashboard = ObjectiveConfig.from_train_config(
        resolve("underfit-dashboard", {"padding_loss_weight": 0.3, "mask_padding_attention": False})
    )
    assert dashboard.inpaint_mask_probabilities == (0.2, 0.6, 0.2) and dashboard.padding_loss_weight == 0.3
