"""AdamW (torch semantics), lr schedules, clipping, accumulation and bit-exact optimizer resume."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from sa3mlx.train import optim as O


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "blocks": [
            {
                "A": mx.array(rng.standard_normal((4, 3)).astype(np.float32)),
                "magnitude": mx.array(rng.standard_normal(3).astype(np.float32) + 2),
            }
        ],
        "embed.lora_B": mx.array(rng.standard_normal((2, 5)).astype(np.float32)),
    }


def _grads(step, params):
    rng = np.random.default_rng(100 + step)
    return tree_map(lambda p: mx.array(rng.standard_normal(p.shape).astype(np.float32)), params)


def _torch_adamw(p, grads, lrs, betas, eps, wd):
    """torch.optim.AdamW's update rule in float64."""
    m, v = np.zeros_like(p), np.zeros_like(p)
    for k, (g, lr) in enumerate(zip(grads, lrs), start=1):
        p = p * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - betas[1] ** k) + eps
        p = p - lr / (1 - betas[0] ** k) * m / denom
    return p


def test_adamw_is_torch_adamw():
    cfg = O.AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opt = O.make_adamw(cfg)
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(64).astype(np.float32)
    grads = [rng.standard_normal(64).astype(np.float32) for _ in range(6)]
    lrs = [O.InverseLR(1e-2, inv_gamma=10, power=0.5, warmup=0.5).lr(k) for k in range(6)]
    params = {"w": mx.array(p0)}
    for g, lr in zip(grads, lrs):
        opt.learning_rate = lr
        params = opt.apply_gradients({"w": mx.array(g)}, params)
    want = _torch_adamw(
        p0.astype(np.float64), [g.astype(np.float64) for g in grads], lrs, cfg.betas, cfg.eps, cfg.weight_decay
    )
    np.testing.assert_allclose(np.array(params["w"]), want, rtol=2e-5, atol=1e-7)


def _run(opt, params, steps, start=0):
    for k in range(start, start + steps):
        opt.learning_rate = O.InverseLR(1e-3, inv_gamma=1e6, power=0.5, warmup=0.9).lr(k)
        params = opt.apply_gradients(_grads(k, params), params)
        mx.eval(params, opt.state)
    return params


def test_optimizer_state_resumes_bit_exactly():
    cfg = O.AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    straight = _run(O.make_adamw(cfg), _params(), 6)

    first = O.make_adamw(cfg)
    half = _run(first, _params(), 3)
    saved_state = O.optimizer_state_dict(first)
    saved_params = {k: np.array(v) for k, v in tree_flatten(half)}
    assert saved_state["step"] == 3 and "blocks.0.A.m" in saved_state and "embed.lora_B.v" in saved_state

    resumed = O.make_adamw(cfg)
    params = tree_unflatten([(k, mx.array(v)) for k, v in saved_params.items()])
    state_object = resumed.state
    O.load_optimizer_state(resumed, saved_state, params)
    assert resumed.state is state_object  # refilled in place (what a compiled step captured)
    finished = _run(resumed, params, 3, start=3)
    for (k, a), (_, b) in zip(tree_flatten(straight), tree_flatten(finished)):
        assert np.array(a).tobytes() == np.array(b).tobytes(), k


def test_load_optimizer_state_rejects_other_parameters():
    opt = O.make_adamw(O.AdamWConfig(lr=1e-3))
    state = O.optimizer_state_dict(opt) | {"stranger.m": np.zeros(1, np.float32)}
    with pytest.raises(KeyError):
        O.load_optimizer_state(opt, state, _params())


def test_inverse_lr_matches_the_dashboard_template():
    sched = O.make_schedule("inverse", 1e-4, {"inv_gamma": 1e6, "power": 0.5, "warmup": 0.995, "final_lr": 0})
    assert sched.lr(0) == pytest.approx(0.005e-4, rel=1e-9)
    assert sched.lr(199) / 1e-4 == pytest.approx(1 - 0.995**200, rel=1e-3)
    assert 0.62 < sched.lr(199) / 1e-4 < 0.64 and sched.lr(918) / 1e-4 > 0.98
    assert O.InverseLR(1.0, inv_gamma=1, power=1, final_lr=0.3).lr(9) == pytest.approx(0.3)
    assert O.make_schedule("none", 2e-4).lr(12345) == 2e-4
    with pytest.raises(ValueError):
        O.make_schedule("cosine", 1e-4)
    with pytest.raises(ValueError):
        O.make_schedule("inverse", 1e-4, {"gamma": 1})


def test_wsd_plan_is_frozen_once_and_resumes():
    sched = O.make_schedule("wsd", 1e-3, {"max_minutes": 10})
    with pytest.raises(RuntimeError):
        sched.lr(0)
    sched.add_elapsed(60.0)  # one minute already spent (e.g. before a resume)
    plan = sched.freeze(seconds_per_step=0.54, steps_done=100)
    assert plan.total_steps == 100 + int(540 // 0.54)
    assert plan.warmup_steps == int(np.ceil(0.02 * plan.total_steps))
    assert sched.freeze(99.0) is plan  # frozen: a later measurement changes nothing
    n = plan.total_steps
    lrs = np.array([sched.lr(k) for k in range(n)])
    assert lrs[0] == pytest.approx(1e-3 / plan.warmup_steps)
    assert np.all(np.diff(lrs[: plan.warmup_steps]) > 0)
    assert np.all(lrs[plan.warmup_steps : n - plan.decay_steps] == 1e-3)
    assert lrs[-1] == pytest.approx(1e-4) and np.all(np.diff(lrs[n - plan.decay_steps :]) < 0)
    assert not sched.finished(n - 1) and sched.finished(n)

    other = O.make_schedule("wsd", 1e-3, {"max_minutes": 10})
    other.load_state_dict(sched.state_dict())
    assert [other.lr(k) for k in range(n)] == lrs.tolist()
    with pytest.raises(ValueError):
        O.make_schedule("none", 1e-3).load_state_dict(sched.state_dict())


def test_clip_grad_norm_is_torch_and_returns_the_post_clip_norm():
    grads = {"a": mx.array([3.0, 4.0]), "b": [mx.array([[12.0]])]}
    assert float(O.global_norm(grads)) == pytest.approx(13.0)
    clipped, post = O.clip_grad_norm(grads, 1.0)
    coef = 1.0 / (13.0 + 1e-6)
    np.testing.assert_allclose(np.array(clipped["a"]), [3 * coef, 4 * coef], rtol=1e-6)
    assert float(post) == pytest.approx(13.0 * coef, rel=1e-6) and float(post) <= 1.0
    same, norm = O.clip_grad_norm(grads, 100.0)
    assert np.array_equal(np.array(same["a"]), [3.0, 4.0]) and float(norm) == pytest.approx(13.0)
    unclipped, norm = O.clip_grad_norm(grads, None)
    assert unclipped is grads and float(norm) == pytest.approx(13.0)


def test_accumulated_gradient_is_the_mean():
    parts = [{"w": mx.array([1.0, 2.0])}, {"w": mx.array([3.0, 6.0])}]
    total = None
    for g in parts:
        total = O.accumulate(total, g)
    assert np.array(O.average(total, 2)["w"]).tolist() == [2.0, 4.0]
