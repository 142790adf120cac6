"""MLX modules that wrap a frozen nn.Linear / nn.Conv1d with one adapter.

The wrapper keeps the base layer's `weight`/`bias` under their own names (so converted base
weights still load by the same module path) and adds the adapter tensors beside them, under
their checkpoint names. Trainable = adapter tensors only; base weight, bias and -xs bases
are frozen. `materialize=False` selects the unmaterialised form (low-rank branch plus, for
DoRA/BoRA, row/column gains from the norm identities) where it exists.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from sa3mlx.lora.maths import base_squares, direction_gains, effective_weight_2d, low_rank_factors
from sa3mlx.lora.svd import svd_bases
from sa3mlx.lora.types import SAVED_PARAMS, AdapterKind, adapter_kind
from sa3mlx.runtime.errors import UserError
from sa3mlx.runtime.precision import compute_dtype

FROZEN_KEYS = ["weight", "bias", "U", "V"]


class LoRAShapeError(UserError, ValueError):
    """Adapter tensors that do not fit the layer they are loaded into."""


class AdaptedLayer(nn.Module):
    """Common part of LoRALinear and LoRAConv1d; subclasses define the 2-D view and the op."""

    def __init__(
        self,
        base: nn.Module,
        adapter_type: str,
        rank: int,
        alpha: float | None = None,
        *,
        bases: dict[str, np.ndarray] | None = None,
        key: mx.array | None = None,
        materialize: bool = True,
    ):
        super().__init__()
        self.weight = base.weight
        if "bias" in base:
            self.bias = base.bias
        self.kind: AdapterKind = adapter_kind(adapter_type)
        self.rank = rank
        self.alpha = rank if alpha is None else alpha
        self.strength = 1.0
        self.materialize = materialize
        self._init_adapter(bases, key)
        self.freeze_base()
        if self.kind.directional:
            self.__dict__["_squares"] = base_squares(self.weight_2d(), self.kind)
            mx.eval(self.__dict__["_squares"])  # now: a compiled call must find it computed

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def fan_out_in(self) -> tuple[int, int]:
        fan_out = self.weight.shape[0]
        return fan_out, self.weight.size // fan_out

    def _init_adapter(self, bases: dict[str, np.ndarray] | None, key: mx.array | None) -> None:
        """Official init: A ~ U(±1/√fan_in), B = 0, M_xs = 0, magnitudes = norms of the base,
        U/V = canonical SVD of the base weight as loaded (upcast to fp32)."""
        fan_out, fan_in = self.fan_out_in
        w2 = self.weight_2d()
        if self.kind.xs:
            if bases is None:
                bases = svd_bases(np.array(w2.astype(mx.float32)), self.rank)
            self.U = mx.array(np.asarray(bases["U"])[:, : self.rank], dtype=mx.float32)
            self.V = mx.array(np.asarray(bases["V"])[:, : self.rank], dtype=mx.float32)
            self.M_xs = mx.zeros((self.rank, self.rank), mx.float32)
        else:
            bound = 1.0 / math.sqrt(fan_in)
            self.lora_A = mx.random.uniform(-bound, bound, (self.rank, fan_in), mx.float32, key=key)
            self.lora_B = mx.zeros((fan_out, self.rank), mx.float32)
        norms = {"magnitude_r": _base_norms(w2, 1), "magnitude_c": _base_norms(w2, 0)}
        if self.kind.norm == "rows":
            self.magnitude = norms["magnitude_r"]
        elif self.kind.norm == "cols":
            self.magnitude = norms["magnitude_c"]
        elif self.kind.norm == "both":
            self.magnitude_r, self.magnitude_c = norms["magnitude_r"], norms["magnitude_c"]

    def freeze_base(self) -> None:
        """Freeze everything but the adapter tensors (call again after a model-wide unfreeze)."""
        self.freeze(recurse=False, keys=FROZEN_KEYS, strict=False)

    def adapter_tensors(self) -> dict[str, mx.array]:
        """Adapter parameters and -xs bases, by their official names."""
        return {k: self[k] for k in (*SAVED_PARAMS, "U", "V") if k in self}

    def lora_state(self) -> dict[str, mx.array]:
        """The tensors a checkpoint stores for this layer (never U/V)."""
        return {k: self[k] for k in SAVED_PARAMS if k in self}

    def load_lora_state(self, state: dict[str, np.ndarray], name: str = "layer") -> None:
        """Set adapter tensors from a checkpoint (cast to fp32); shapes must match exactly."""
        fan_out, fan_in = self.fan_out_in
        expected = self.kind.param_shapes(self.rank, fan_out, fan_in)
        for param, shape in expected.items():
            if param not in state:
                raise LoRAShapeError(f"{name}: checkpoint has no '{param}' for adapter type {self.kind.name}")
            got = tuple(np.shape(state[param]))
            if got != shape:
                raise LoRAShapeError(
                    f"{name}: {param} has shape {got} but this layer ({fan_out}x{fan_in}, rank {self.rank}) "
                    f"needs {shape} (trained for a different base?)"
                )
        for param in expected:
            self[param] = mx.array(np.asarray(state[param], dtype=np.float32))

    def effective_weight(self) -> mx.array:
        """The adapted weight in the layer's own MLX layout, in the base's compute dtype."""
        w2 = effective_weight_2d(self.weight_2d(), self.kind, self.adapter_tensors(), self.scale, self.strength)
        return self.weight_from_2d(w2)

    def __call__(self, x: mx.array) -> mx.array:
        # strength 0 is the base weight itself for every type (exact for LoRA/-xs too: W + 0·Δ = W)
        if self.strength == 0:
            return self.apply_with_bias(x, self.weight.astype(compute_dtype(self.weight.dtype)))
        if self.materialize or not self.has_fast_form():
            return self.apply_with_bias(x, self.effective_weight())
        y = self.apply_unmaterialized(x).astype(compute_dtype(self.weight.dtype))  # fp32 adapters: cast back
        return y + self.bias if "bias" in self else y

    def apply_with_bias(self, x: mx.array, weight: mx.array) -> mx.array:
        y = self.apply(x, weight)
        return y + self.bias if "bias" in self else y

    def apply_unmaterialized(self, x: mx.array) -> mx.array:
        """base(x·col) + c·branch(x·col), times row: the adapted layer without building its weight."""
        tensors = self.adapter_tensors()
        left, right = low_rank_factors(self.kind, tensors)
        weight = self.weight.astype(compute_dtype(self.weight.dtype))
        y = w_right = None
        if self.kind.directional and self.kind.norm == "rows" and self.stacks(x, weight):
            y, w_right = self.apply_stacked(x, weight, right)
        row = col = None
        if self.kind.directional:
            squares = self.base_squares()
            row, col = direction_gains(
                self.weight_2d(), self.kind, tensors, self.scale, self.strength, squares, w_right
            )
        if col is not None:
            x = x * col
        y = self.apply(x, weight) if y is None else y
        y = y + (self.scale * self.strength) * (self.apply(x, self.weight_from_2d(right)) @ left.T)
        return y * row if row is not None else y

    def stacks(self, x: mx.array, weight: mx.array) -> bool:
        """Whether `apply_stacked` gives this layer's x·Wᵀ and W·Rᵀ (fp32 linear layers)."""
        return False

    def apply_stacked(self, x: mx.array, weight: mx.array, right: mx.array) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def has_fast_form(self) -> bool:
        return True

    def base_squares(self) -> dict[str, mx.array]:
        """`maths.base_squares` of the frozen weight, computed when the adapter is made and kept outside
        the module's parameters (the base weight never changes under an adapter), so no call (nor
        its recompute) passes over the weight for it."""
        return self.__dict__["_squares"]

    def weight_2d(self) -> mx.array:
        raise NotImplementedError

    def weight_from_2d(self, w2: mx.array) -> mx.array:
        raise NotImplementedError

    def apply(self, x: mx.array, weight: mx.array) -> mx.array:
        raise NotImplementedError


class LoRALinear(AdaptedLayer):
    def __init__(self, base: nn.Module, *args, fused_bias: bool = True, **kwargs):
        super().__init__(base, *args, **kwargs)
        # nn.Linear adds its bias inside the matmul (addmm), whose rounding differs from x@Wᵀ + b;
        # keep the base's own form so that strength 0 reproduces it bit for bit
        self.fused_bias = fused_bias

    def apply_with_bias(self, x: mx.array, weight: mx.array) -> mx.array:
        if "bias" in self and self.fused_bias:
            return mx.addmm(self.bias, x, weight.T)
        return super().apply_with_bias(x, weight)

    def weight_2d(self) -> mx.array:
        return self.weight

    def weight_from_2d(self, w2: mx.array) -> mx.array:
        return w2

    def apply(self, x: mx.array, weight: mx.array) -> mx.array:
        return x @ weight.T

    def stacks(self, x: mx.array, weight: mx.array) -> bool:
        return x.dtype == weight.dtype == mx.float32

    def apply_stacked(self, x: mx.array, weight: mx.array, right: mx.array) -> tuple[mx.array, mx.array]:
        """(x·Wᵀ, W·Rᵀ) from one matmul, R's rows stacked under x's: the frozen W is read (and packed by
        the BLAS) once per call and once per backward instead of twice; each product row is the same
        dot products as alone (measured bit-identical on OpenBLAS)."""
        rows = x.reshape(-1, x.shape[-1])
        y, r_w = mx.split(mx.concatenate([rows, right]) @ weight.T, [rows.shape[0]])
        # W·Rᵀ as its own array: a view would keep the whole product alive until the backward (which
        # needs it for d(left)); measured +1.6 GB at crop 1300
        return y.reshape(*x.shape[:-1], weight.shape[0]), mx.contiguous(r_w.T)


class LoRAConv1d(AdaptedLayer):
    """MLX conv weights are (out, k, in); the adapter sees torch's (out, in·k), in-major."""

    def __init__(self, base: nn.Conv1d, *args, **kwargs):
        super().__init__(base, *args, **kwargs)
        self.stride, self.padding = base.stride, base.padding
        self.dilation, self.groups = base.dilation, base.groups

    def weight_2d(self) -> mx.array:
        return self.weight.transpose(0, 2, 1).reshape(self.weight.shape[0], -1)

    def weight_from_2d(self, w2: mx.array) -> mx.array:
        taps = self.weight.shape[1]
        return w2.reshape(w2.shape[0], -1, taps).transpose(0, 2, 1)

    def apply(self, x: mx.array, weight: mx.array) -> mx.array:
        return mx.conv1d(x, weight, self.stride, self.padding, self.dilation, self.groups)

    def has_fast_form(self) -> bool:
        """Column gains are per (input channel, tap): only k = 1 turns them into an input scaling."""
        return self.groups == 1 and (self.kind.norm in ("none", "rows") or self.weight.shape[1] == 1)


def _base_norms(w2: mx.array, axis: int) -> mx.array:
    """Norms of the base weight as torch gives them (in the dtype the base computes in), kept as fp32."""
    return mx.linalg.norm(w2.astype(mx.float32), axis=axis).astype(compute_dtype(w2.dtype)).astype(mx.float32)


def wrap(base: nn.Module, *args, **kwargs) -> AdaptedLayer:
    """LoRALinear or LoRAConv1d for an nn.Linear / nn.Conv1d."""
    if isinstance(base, nn.Conv1d):
        return LoRAConv1d(base, *args, **kwargs)
    if isinstance(base, nn.Linear):
        return LoRALinear(base, *args, **kwargs)
    raise TypeError(f"cannot adapt a {type(base).__name__} (only nn.Linear and nn.Conv1d)")


def build_adapters(
    bases: dict[str, nn.Module],
    adapter_type: str,
    rank: int,
    alpha: float | None = None,
    *,
    seed: int = 0,
    svd: dict[str, dict[str, np.ndarray]] | None = None,
    materialize: bool = True,
) -> dict[str, AdaptedLayer]:
    """Wrap each named base layer (checkpoint-convention names, in order); the A init of layer i
    uses the i-th split of `seed`'s key, so the same seed gives the same adapters."""
    keys = mx.random.split(mx.random.key(seed), max(len(bases), 2))
    return {
        name: wrap(layer, adapter_type, rank, alpha, bases=(svd or {}).get(name), key=keys[i], materialize=materialize)
        for i, (name, layer) in enumerate(bases.items())
    }
