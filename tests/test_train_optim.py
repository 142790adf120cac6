"""AdamW (torch semantics), lr schedules, clipping, accumulation and bit-exact optimizer resume."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from sa3mlx.runtime import kernels, native
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


def _flat_params(seed=0):
    """Adapter-like tensors: big enough for several native chunks and groups, one of them a transposed view."""
    rng = np.random.default_rng(seed)
    shapes = [(16, 3000), (70000,), (5, 7), (1,)] + [(3, 11)] * (kernels.ADAMW_GROUP + 1)
    values = {f"t{i}": mx.array(rng.standard_normal(s).astype(np.float32)) for i, s in enumerate(shapes)}
    values["t0"] = mx.array(rng.standard_normal((3000, 16)).astype(np.float32)).T
    return values


def _guarded_steps(route, lrs, scales, grad_clip, bad_step=None):
    """`guarded_update` on one kernel route: (values, moments, step, [(norm, finite, magnitude)]) as numpy."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in kernels.ENVIRONMENT[route].items():
            patch.setenv(name, value)
        values = _flat_params()
        opt = O.make_adamw(O.AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01))
        opt.init(values)
        assert O._native_update_applies(opt, values, values) == (route == kernels.NATIVE)
        outputs = []
        for k, (lr, scale) in enumerate(zip(lrs, scales)):
            opt.learning_rate = lr
            grads = {key: scale * g for key, g in _flat_params(seed=k + 1).items()}
            if k == bad_step:
                grads["t2"] = grads["t2"] * mx.array([np.inf] + [1.0] * 6, mx.float32)
            out = O.guarded_update(opt, grads, values, mx.array(True), grad_clip)
            mx.eval(out, values, opt.state)
            outputs.append(tuple(float(o) for o in out))
        moments = {f"{k}.{s}": np.array(opt.state[k][s]) for k in values for s in ("m", "v")}
        return {k: np.array(v) for k, v in values.items()}, moments, int(opt.state["step"]), outputs


@pytest.mark.parametrize("grad_clip", [1.0, None])
def test_native_adamw_update_is_mlx_adamw(grad_clip):
    if not native.supported():
        pytest.skip("native kernels: this CPU has no AVX2/FMA")
    # clipped where the norm is above 1; the first step's |g| ~ eps, where eps weighs in the update
    lrs, scales = [1e-3, 2e-3, 5e-4, 1e-3], [1e-8, 1.0, 0.003, 0.5]
    want = _guarded_steps(kernels.MLX, lrs, scales, grad_clip)
    got = _guarded_steps(kernels.NATIVE, lrs, scales, grad_clip)
    assert got[2] == want[2] == 4
    for k in want[0]:
        np.testing.assert_allclose(got[0][k], want[0][k], rtol=2e-6, atol=1e-7, err_msg=k)  # lr·1e-4
    for k in want[1]:
        scale = np.abs(want[1][k]).max()  # the clip factors differ in their last bits (sums in another order)
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)
    np.testing.assert_allclose(np.array(got[3]), np.array(want[3]), rtol=2e-5)
    norms = [o[0] for o in got[3]]
    assert (norms[1] == pytest.approx(1.0, rel=1e-5)) == (grad_clip is not None)


@pytest.mark.parametrize("route", [kernels.NATIVE, kernels.MLX])
def test_a_non_finite_gradient_leaves_values_moments_and_step_unchanged(route):
    if route == kernels.NATIVE and not native.supported():
        pytest.skip("native kernels: this CPU has no AVX2/FMA")
    lrs, scales = [1e-3] * 3, [0.1] * 3
    two = _guarded_steps(route, lrs[:2], scales[:2], 1.0)
    three = _guarded_steps(route, lrs, scales, 1.0, bad_step=2)
    assert three[2] == two[2] == 2
    assert three[3][2][:2] == (0.0, 0.0)  # norm 0, not finite
    for k in two[0]:
        assert three[0][k].tobytes() == two[0][k].tobytes(), k
    for k in two[1]:
        assert three[1][k].tobytes() == two[1][k].tobytes(), k


def test_native_sum_squares_is_accurate():
    if not native.supported():
        pytest.skip("native kernels: this CPU has no AVX2/FMA")
    arrays = list(_flat_params().values())
    want = [np.sum(np.array(a, np.float64) ** 2) for a in arrays]
    np.testing.assert_allclose(np.array(kernels.sum_squares(arrays)), want, rtol=1e-6)
