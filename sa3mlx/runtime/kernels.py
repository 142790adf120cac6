"""Element-wise transcendental kernels (exp, softmax, sigmoid, SiLU), fast on x86 CPUs.

MLX's x86 CPU backend evaluates `exp` with SIMD width 1 and a library `fma` call per
polynomial step (~12 ns per element, 50x a multiply), so `mx.softmax`, `mx.sigmoid` and
`nn.silu` cost as much as the matmuls around them. Here `exp` is the same Cephes scheme
written as MLX arithmetic under `mx.compile`, which g++ vectorises: Cody-Waite reduction
x = n·ln2 + r, a degree-7 polynomial for e^r, then 2^n. `exp` builds 2^n from the exponent
bits (relative error <= 1.5e-7 on [-87.3, 88.3], MLX's own: 8.8e-7; 0 below, inf above, NaN
kept). Softmax (after its max) and sigmoid (of -|x|) only need x <= 0, where 2^n comes from
two integer shifts instead: no bit view, so the whole exp fuses into one kernel.

`mx.compile` does not apply inside an eager `mx.grad`/`mx.vjp` trace, so there the forward
runs at about MLX's speed; under a compiled step (training, `compiled_forward`) it fuses.
Gradients are exact formulas of the saved outputs (custom VJPs, MLX's formulas).

Faster still, where it can be built (x86-64 with AVX2 and FMA): the native kernels of
`runtime/native.py` (`cpu_kernels.cpp`), which compute softmax, sigmoid, SwiGLU, RMSNorm and RoPE and their
backward passes in one pass over each row, on every core, at any size (measured: softmax of
[16, 320, 320] 0.8 ms vs 10.8 ms compiled here and 19.6 ms MLX's; SwiGLU 0.5 ms vs 21.6 ms MLX's; RoPE of
[16, 320, 64] 0.19 ms vs 0.50 forward, 0.21 vs 0.75 backward), and the AdamW step (`adamw`, `sum_squares`).

The one switch, `kernel_path(x)`: on the CPU device for float32 inputs, "native" when the native
module loads, else "compiled" for inputs of at most FAST_MAX_BYTES; "mlx" otherwise, and always
with SA3MLX_FAST_KERNELS=0 (SA3MLX_NATIVE_KERNELS=0 leaves the compiled kernels on). Elsewhere
(Metal, CUDA, other dtypes) every function here is MLX's own op.
"""

from __future__ import annotations

import functools
import math
import os

import mlx.core as mx
import mlx.nn as nn

from sa3mlx.runtime import native
from sa3mlx.runtime.precision import on_cpu

SWITCH = "SA3MLX_FAST_KERNELS"
# Above this size MLX's kernels run: measured on the 2-core machine, the compiled small-music train
# step at crop 1300 (22-119 MB activations) took 18 s/step with the fast kernels vs 12-14 s without,
# also with the 119 MB softmax alone left to MLX; at crop 256 (<= 6.5 MB) they are faster. Cause
# not yet found (the multi-pass memory traffic of the compiled graphs is the suspect).
FAST_MAX_BYTES = 8 * 2**20
LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so n·LN2_HI is exact for |n| < 2**10
EXP_LO, EXP_HI = -87.33654, 88.37626  # the range where 2^n stays a normal float32
NEG_LO, NEG_SHIFT_BIAS = -41.5, -60  # `_exp_nonpositive`: n in [-60, 0] so 2^(n+60) = 2^a·2^b, a, b <= 30
ROUND_MAGIC = 12582912.0  # 1.5·2^23: (y + M) - M rounds y to the nearest integer without a floor call
EXP_POLY = (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3, 1.3981999507e-3, 1.9875691500e-4)


NATIVE, COMPILED, MLX = "native", "compiled", "mlx"  # the kernel paths, fastest first
ENVIRONMENT = {  # the switches that select each path (tests and benches set them from here)
    NATIVE: {SWITCH: "1", native.SWITCH: "1"},
    COMPILED: {SWITCH: "1", native.SWITCH: "0"},
    MLX: {SWITCH: "0", native.SWITCH: "1"},
}


def kernel_path(x: mx.array, nbytes: int | None = None) -> str:
    """Which kernels x (or a float32 result of `nbytes` made from it) goes through."""
    if x.dtype != mx.float32 or not on_cpu() or os.environ.get(SWITCH, "1").lower() in ("0", "off", "false"):
        return MLX
    if native.load() is not None:
        return NATIVE
    return COMPILED if (x.nbytes if nbytes is None else nbytes) <= FAST_MAX_BYTES else MLX


def fast_path(x: mx.array, nbytes: int | None = None) -> bool:
    """Whether x goes through the kernels here (native or compiled) rather than MLX's own."""
    return kernel_path(x, nbytes) != MLX


def _exp_reduced(x: mx.array) -> tuple[mx.array, mx.array]:
    """(e^r, n) with x = n·ln2 + r, |r| <= ln2/2, for x already clamped to a finite range."""
    n = (x * LOG2E + ROUND_MAGIC) - ROUND_MAGIC
    r = (x - n * LN2_HI) - n * LN2_LO
    r2 = r * r
    c0, c1, c2, c3, c4, c5 = EXP_POLY
    p = (c0 + c1 * r) + r2 * ((c2 + c3 * r) + r2 * (c4 + c5 * r))  # Estrin: a shallow graph fuses better
    return (p * r2 + r) + 1.0, n


def _exp_poly(x: mx.array) -> mx.array:
    e_r, n = _exp_reduced(mx.clip(x, EXP_LO, EXP_HI))
    two_n = mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
    return mx.where(x > EXP_HI, mx.inf, mx.where(x < EXP_LO, 0.0, e_r * two_n))


def _exp_nonpositive(x: mx.array) -> mx.array:
    """e^x for x <= 0; 0 below NEG_LO, where e^x < 1e-18 is below fp32 resolution next to any O(1) term
    (softmax after its max, sigmoid's e^-|x|). 2^n from two integer shifts converted to float: unlike
    the bit view of `_exp_poly`, that fuses into one compiled kernel (about 1.5x faster)."""
    e_r, n = _exp_reduced(mx.maximum(x, NEG_LO))
    k = n.astype(mx.int32) - NEG_SHIFT_BIAS  # 0..60
    k_low = mx.minimum(k, 30)
    two_n = mx.left_shift(1, k_low).astype(mx.float32) * mx.left_shift(1, k - k_low).astype(mx.float32)
    return mx.where(x < NEG_LO, 0.0, e_r * two_n * 2.0**NEG_SHIFT_BIAS)


def _softmax_last(x: mx.array) -> mx.array:
    e = _exp_nonpositive(x - mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


def _sigmoid(x: mx.array) -> mx.array:
    e = _exp_nonpositive(-mx.abs(x))
    return mx.where(x >= 0, 1.0, e) / (1.0 + e)


_compiled = {f: mx.compile(f) for f in (_exp_poly, _softmax_last, _sigmoid)}


@mx.custom_function
def _fast_exp(x):
    return _compiled[_exp_poly](x)


@_fast_exp.vjp
def _fast_exp_vjp(x, cotangent, out):
    return (cotangent * out,)


@mx.custom_function
def _fast_softmax(x):
    return _compiled[_softmax_last](x)


def _softmax_grad(s: mx.array, cotangent: mx.array) -> mx.array:
    sg = s * cotangent  # MLX's own softmax VJP: s·g - s·Σ(s·g)
    return sg - s * mx.sum(sg, axis=-1, keepdims=True)


@_fast_softmax.vjp
def _fast_softmax_vjp(x, cotangent, s):
    return (_softmax_grad(s, cotangent),)


def _sigmoid_vjp(x, cotangent, s):
    return (cotangent * (s * (1.0 - s)),)


@mx.custom_function
def _fast_sigmoid(x):
    return _compiled[_sigmoid](x)


@mx.custom_function
def _native_softmax(x):
    return native.load().softmax(x)


@_native_softmax.vjp
def _native_softmax_vjp(x, cotangent, s):
    return (native.load().softmax_vjp(s, cotangent),)


@mx.custom_function
def _native_sigmoid(x):
    return native.load().sigmoid(x)


_fast_sigmoid.vjp(_sigmoid_vjp)
_native_sigmoid.vjp(_sigmoid_vjp)


@mx.custom_function
def _native_swiglu(h):
    return native.load().swiglu(h)


@_native_swiglu.vjp
def _native_swiglu_vjp(h, cotangent, out):
    return (native.load().swiglu_vjp(h, cotangent),)


_SOFTMAX = {NATIVE: _native_softmax, COMPILED: _fast_softmax}
_SIGMOID = {NATIVE: _native_sigmoid, COMPILED: _fast_sigmoid}


def exp(x: mx.array) -> mx.array:
    return _fast_exp(x) if fast_path(x) else mx.exp(x)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Softmax along `axis` (max-subtracted, as MLX's precise softmax)."""
    path = kernel_path(x)
    if path == MLX:
        return mx.softmax(x, axis=axis, precise=True)
    if axis in (-1, x.ndim - 1):
        return _SOFTMAX[path](x)
    return mx.swapaxes(_SOFTMAX[path](mx.swapaxes(x, axis, -1)), axis, -1)


def softmax_vjp(s: mx.array, cotangent: mx.array) -> mx.array:
    """The gradient of softmax over the last axis from its output s: s·g - s·Σ(s·g), as MLX's."""
    if kernel_path(s) == NATIVE and cotangent.dtype == mx.float32:
        return native.load().softmax_vjp(s, cotangent)
    return _softmax_grad(s, cotangent)


def sigmoid(x: mx.array) -> mx.array:
    path = kernel_path(x)
    return mx.sigmoid(x) if path == MLX else _SIGMOID[path](x)


def silu(x: mx.array) -> mx.array:
    """x·sigmoid(x); its gradient by autodiff of the product, from the saved sigmoid (no second exp)."""
    return x * sigmoid(x)


GELU_TANH_SCALE = 2 * math.sqrt(2 / math.pi)  # 0.5·(1 + tanh(z)) = sigmoid(2z)
GELU_CUBIC = 0.044715


def gelu_approx(x: mx.array) -> mx.array:
    """The tanh GELU, 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))), on the fast paths as x·sigmoid(2·√(2/π)(…))
    (the same function; no tanh, which MLX's x86 CPU backend evaluates at SIMD width 1)."""
    if kernel_path(x) == MLX:
        return nn.gelu_approx(x)
    return x * sigmoid(GELU_TANH_SCALE * (x + GELU_CUBIC * (x * x * x)))


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`mx.fast.rms_norm` over the last axis (x·rsqrt(mean(x²) + eps)·weight); native: one pass forward and
    one backward per row, on every core, reading rows in place (a head-transposed view is not copied)."""
    if kernel_path(x) == NATIVE and weight.shape == (x.shape[-1],):
        return _native_rms_norm(float(eps))(x, weight.astype(mx.float32))  # an fp16-stored base: exact upcast
    return mx.fast.rms_norm(x, weight, eps)


@functools.cache
def _native_rms_norm(eps: float):
    @mx.custom_function
    def run(x, weight):
        return native.load().rms_norm(x, weight, eps)

    @run.vjp
    def run_vjp(primals, cotangent, output):
        x, weight = primals
        normalized = native.load().rms_norm(x, mx.ones_like(weight), eps)  # evaluated only if the weight trains
        d_weight = (cotangent * normalized).reshape(-1, weight.size).sum(axis=0)
        return native.load().rms_norm_vjp(x, weight, cotangent, eps), d_weight

    return run


def native_rope(x: mx.array, cos: mx.array, sin: mx.array) -> bool:
    """Whether `rope` takes the native kernel: fp32 on the CPU, tables [L, R] of x [..., L, D], R even <= D."""
    shape_fits = x.ndim >= 2 and cos.shape == sin.shape == (x.shape[-2], cos.shape[-1]) and cos.ndim == 2
    fits = shape_fits and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= x.shape[-1]
    return fits and kernel_path(x) == NATIVE and cos.dtype == sin.dtype == mx.float32


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x·cos + rotate_half(x)·sin on the first R dims of x [..., L, D] (half-split pairing), the rest as it is,
    in fp32 or wider; native: one pass forward and one backward per row, on every core (the same bits)."""
    if native_rope(x, cos, sin):
        return _native_rope(x, cos, sin)
    dtype, rot_dim = x.dtype, cos.shape[-1]
    wide = mx.float64 if dtype == mx.float64 else mx.float32
    rot, rest = x[..., :rot_dim].astype(wide), x[..., rot_dim:]
    first, second = rot[..., : rot_dim // 2], rot[..., rot_dim // 2 :]
    rotated = mx.concatenate([-second, first], axis=-1)
    out = (rot * cos + rotated * sin).astype(dtype)
    return mx.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


@mx.custom_function
def _native_rope(x, cos, sin):
    return native.load().rope(x, cos, sin, False)


@_native_rope.vjp
def _native_rope_vjp(primals, cotangent, output):
    x, cos, sin = primals  # the tables are constants (positions · frozen frequencies)
    return native.load().rope(cotangent, cos, sin, True), mx.zeros_like(cos), mx.zeros_like(sin)


def swiglu(h: mx.array) -> mx.array:
    """value·silu(gate) for h = [value | gate] split in halves on the last axis (SwiGLU)."""
    if kernel_path(h) == NATIVE:
        return _native_swiglu(h)
    value, gate = mx.split(h, 2, axis=-1)
    return value * silu(gate)


def all_native(arrays: list[mx.array]) -> bool:
    """Whether `sum_squares` and `adamw` take these tensors (all of them on the native path)."""
    return bool(arrays) and all(kernel_path(a) == NATIVE for a in arrays)


def sum_squares(arrays: list[mx.array]) -> mx.array:
    """[Σ x² of each array] in fp32, one native primitive over all of them, on every core, in fixed chunks
    (the same bytes on any thread count); callers check `all_native`."""
    return native.load().sum_squares(arrays)


ADAMW_GROUP = 16  # tensors per native AdamW call: each output has the call's others as siblings (quadratic)


def adamw(scalars: mx.array, params, grads, ms, vs, betas: tuple[float, float], eps: float):
    """One AdamW step over lists of fp32 tensors in native passes of ADAMW_GROUP tensors (see
    `train/optim.native_adamw_update`): (params, ms, vs, [Σ (g·scale)²] per tensor); `scalars` =
    [grad scale, 1 − lr·wd, lr/(1 − β1^k), 1/√(1 − β2^k), keep the new values (1) or the old (0)]."""
    b1, b2 = betas
    new_params, new_ms, new_vs, sums = [], [], [], []
    for start in range(0, len(params), ADAMW_GROUP):
        group = slice(start, start + ADAMW_GROUP)
        out = native.load().adamw(
            scalars, params[group], grads[group], ms[group], vs[group], b1, 1 - b1, b2, 1 - b2, eps
        )
        n = len(params[group])
        new_params += out[:n]
        new_ms += out[n : 2 * n]
        new_vs += out[2 * n : 3 * n]
        sums.append(out[3 * n])
    return new_params, new_ms, new_vs, mx.concatenate(sums)
