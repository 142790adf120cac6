"""One training step on device: the adapted model's prediction and loss, and the compiled core
that turns a batch into (loss, adapter gradients, clipped AdamW update).

A prepared batch is a dict of arrays with fixed shapes (see `BATCH_KEYS`): latents `x0`
[B,C,T], `noise`, shifted `t` [B], raw prompt hidden states `prompt_hidden` [B,N,768] and
`prompt_mask` [B,N], `seconds` [B], `drop` [B] (CFG dropout), `padding_mask` [B,T] and, with
inpainting masks, `inpaint_mask` [B,1,T].

The trainable state is the adapter tensors by checkpoint key (`AdapterParams`); the core reads
and writes them and the optimizer state as compile inputs/outputs, so one compiled graph serves
every step. A non-finite loss or gradient leaves both unchanged (the update is selected away
inside the graph) and reports `finite = False`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import mlx.core as mx
import mlx.optimizers as optim

from sa3mlx.lora.checkpoint import lora_key
from sa3mlx.lora.layers import AdaptedLayer
from sa3mlx.models.conditioning import Conditioner
from sa3mlx.models.dit import DiT
from sa3mlx.runtime.precision import compile_notice
from sa3mlx.train.objective import ObjectiveConfig, drop_cross_attention, local_add_cond, objective_loss, rectified_flow
from sa3mlx.train.optim import accumulate, average, guarded_update

# adapters train in their unmaterialised form (low-rank branch + DoRA gains): no full-size weight
# gradient per adapted layer, ~3x faster on the CPU than building the effective weights
TRAIN_MATERIALIZE = False
BATCH_KEYS = ("x0", "noise", "t", "prompt_hidden", "prompt_mask", "seconds", "drop", "padding_mask")
OPTIONAL_KEYS = ("inpaint_mask",)


def predict(
    dit: DiT, cond: Conditioner, batch: dict, cfg: ObjectiveConfig, capture: dict | None = None
) -> tuple[mx.array, mx.array]:
    """(velocity v [B,C,T], target [B,C,T]) of a prepared batch through the (adapted) model."""
    x0 = batch["x0"]
    noised, target = rectified_flow(x0, batch["noise"], batch["t"])
    inputs = cond.assemble(batch["prompt_hidden"], batch["prompt_mask"], batch["seconds"])
    cross = drop_cross_attention(inputs.cross_attn_cond, batch["drop"])
    if capture is not None:
        capture.update(
            noised=noised, target=target, cross_attn_cond=inputs.cross_attn_cond, global_cond=inputs.global_cond
        )
    padding = batch["padding_mask"] if cfg.dit_padding_mask else None
    v = dit(
        noised,
        batch["t"],
        cross,
        inputs.global_cond,
        local_add_cond(x0, batch.get("inpaint_mask")),
        padding_mask=padding,
    )
    return v, target


def batch_loss(
    dit: DiT, cond: Conditioner, batch: dict, cfg: ObjectiveConfig, capture: dict | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """(loss, per-sample loss [B], v) of a prepared batch."""
    v, target = predict(dit, cond, batch, cfg, capture)
    loss, per_sample = objective_loss(v, target, batch["padding_mask"], batch.get("inpaint_mask"), cfg)
    return loss, per_sample, v


class AdapterParams:
    """The trainable adapter tensors under their checkpoint keys, and the layer slot of each."""

    def __init__(self, layers: dict[str, AdaptedLayer]):
        self.slots = {
            lora_key(name, param): (layer, param) for name, layer in layers.items() for param in layer.lora_state()
        }

    def read(self) -> dict[str, mx.array]:
        return {key: layer[param] for key, (layer, param) in self.slots.items()}

    def write(self, values: dict[str, mx.array]) -> None:
        for key, value in values.items():
            layer, param = self.slots[key]
            layer[param] = value


def loss_and_grads(dit: DiT, cond: Conditioner, params: AdapterParams, cfg: ObjectiveConfig) -> Callable:
    """f(values, batch) -> ((loss, per_sample, v), grads by checkpoint key)."""

    def loss_fn(values: dict, batch: dict):
        params.write(values)
        return batch_loss(dit, cond, batch, cfg)

    return mx.value_and_grad(loss_fn)


class StepCore:
    """Loss, gradients, clipping and the guarded AdamW update over the adapter tensors.

    `run(batches)` takes one prepared batch per micro-batch: with one, a single compiled graph
    does everything; with several (gradient accumulation), a compiled gradient graph per
    micro-batch, their sum, then a compiled update graph. `reduce` turns the sums of the loss and
    gradients into means over every micro-batch, of every rank in a data-parallel run (one
    division, after the sum across ranks), so 2 ranks of one micro-batch each compute what 1 rank
    with 2 micro-batches does. Returns mx scalars (loss = mean of the micro-batch losses,
    post-clip grad norm, finite, adapter norm before the update).
    """

    def __init__(
        self,
        dit: DiT,
        cond: Conditioner,
        layers: dict[str, AdaptedLayer],
        cfg: ObjectiveConfig,
        optimizer: optim.Optimizer,
        grad_clip: float | None = None,
        compile: bool = True,
    ):
        self.params = AdapterParams(layers)
        self.values = self.params.read()
        self.optimizer, self.grad_clip = optimizer, grad_clip
        self.reduce = keep_local  # (loss sum, grad sums, micro-batches) -> means (World.average across ranks)
        optimizer.init(self.values)
        self._value_and_grad = loss_and_grads(dit, cond, self.params, cfg)
        self.compiled = compile
        state = [self.values, optimizer.state]
        if compile:
            self._fused = mx.compile(self._fused_fn, inputs=state, outputs=state)
            self._grads = mx.compile(self._grads_fn, inputs=state)
            self._update = mx.compile(self._update_fn, inputs=state, outputs=state)
        else:
            self._fused, self._grads, self._update = self._fused_fn, self._grads_fn, self._update_fn
        self._compiled = compile

    def _grads_fn(self, batch: dict):
        (loss, _, _), grads = self._value_and_grad(self.values, batch)
        return loss, grads

    def _update_fn(self, grads: dict, finite: mx.array):
        """Clip, AdamW, and keep the old values and moments where anything is non-finite."""
        return guarded_update(self.optimizer, grads, self.values, finite, self.grad_clip)

    def _fused_fn(self, batch: dict):
        loss, grads = self.reduce(*self._grads_fn(batch), 1)
        return (loss, *self._update_fn(grads, mx.isfinite(loss)))

    def run(self, batches: list[dict]) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        notice = compile_notice("the training step", batches) if self._compiled else nullcontext()
        try:
            with notice:
                if len(batches) == 1:
                    out = self._fused(batches[0])
                else:
                    out = self._accumulated(batches)
                mx.eval(out, self.values, self.optimizer.state)
        finally:
            self.params.write(self.values)  # the traced call left placeholders in the layers
        return out

    def _accumulated(self, batches: list[dict]):
        total, loss_sum = None, None
        for batch in batches:
            loss, grads = self._grads(batch)
            self.params.write(self.values)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            total = accumulate(total, grads)
        loss, grads = self.reduce(loss_sum, total, len(batches))
        return (loss, *self._update(grads, mx.isfinite(loss)))

    def load_values(self, values: dict[str, mx.array]) -> None:
        """Replace the adapter tensors in place (the compiled graphs keep reading this dict)."""
        unknown = sorted(set(values) - set(self.values))
        if unknown:
            raise KeyError(f"no adapter tensor {unknown[:3]} in this session")
        for key in self.values:
            self.values[key] = mx.array(values[key]).astype(mx.float32)
        self.params.write(self.values)


def keep_local(loss_sum: mx.array, grad_sums: dict, count: int) -> tuple[mx.array, dict]:
    """One process: the means of `count` micro-batches' loss and gradients (as they are for one)."""
    if count == 1:
        return loss_sum, grad_sums
    return loss_sum / count, average(grad_sums, count)
