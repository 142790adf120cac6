"""The SA3 diffusion transformer (`DiffusionTransformer` with adaLN global conditioning).

    v = DiT(cfg)(x [B,C,T], t [B], cross_attn_cond [B,N+1,768], global_cond [B,768],
                 local_add_cond [B,C+1,T] or None)

Parameter names equal the converted `dit.npz` keys (without the `cond.` conditioner
keys, which live in `conditioning.Conditioner`).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from sa3mlx.models.config import DiTConfig
from sa3mlx.models.dit_layers import RotaryEmbedding, TransformerBlock
from sa3mlx.models.fourier import expo_fourier_features, expo_frequencies
from sa3mlx.runtime.precision import compile_notice, compute_dtype


def _mlp(in_dim: int, dim: int, bias: bool) -> list:
    """Linear, SiLU, Linear (the SiLU slot is None so the indices match torch's Sequential)."""
    return [nn.Linear(in_dim, dim, bias=bias), None, nn.Linear(dim, dim, bias=bias)]


def _run_mlp(layers: list, x: mx.array) -> mx.array:
    return layers[2](nn.silu(layers[0](x)))


class ContinuousTransformer(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        E = cfg.embed_dim
        self.num_memory_tokens = cfg.num_memory_tokens
        self.project_in = nn.Linear(cfg.io_channels, E, bias=False)
        self.project_out = nn.Linear(E, cfg.io_channels, bias=False)
        self.memory_tokens = mx.zeros((cfg.num_memory_tokens, E))
        self.rotary_pos_emb = RotaryEmbedding(cfg.rope_dim)
        self.global_cond_embedder = [nn.Linear(E, E), None, nn.Linear(E, 6 * E)]
        self.layers = [
            TransformerBlock(E, cfg.num_heads, cfg.ff_inner, cfg.local_add_cond_dim, cfg.differential)
            for _ in range(cfg.depth)
        ]
        # gradient checkpointing: keep only each block's input for the backward, recompute the rest
        self.checkpoint_blocks = False

    def __call__(
        self,
        x: mx.array,
        context: mx.array,
        global_embed: mx.array,
        local_cond: mx.array | None,
        capture: dict | None = None,
        padding_mask: mx.array | None = None,
    ) -> mx.array:
        """x [B,T,C] -> [B,T,C]; memory tokens first, RoPE positions count them from 0.
        padding_mask [B,T] (True = real): the memory tokens are prepended as valid."""
        B = x.shape[0]
        h = self.project_in(x)
        memory = mx.broadcast_to(self.memory_tokens[None].astype(h.dtype), (B, *self.memory_tokens.shape))
        h = mx.concatenate([memory, h], axis=1)
        adaln = self.global_cond_embedder[2](nn.silu(self.global_cond_embedder[0](global_embed)))
        rope = self.rotary_pos_emb.tables(h.shape[1])
        _put(capture, project_in_out=h[:, self.num_memory_tokens :], adaln_cond=adaln)
        key_mask = None
        if padding_mask is not None:
            memory_valid = mx.ones((B, self.num_memory_tokens), dtype=mx.bool_)
            key_mask = mx.concatenate([memory_valid, padding_mask.astype(mx.bool_)], axis=1)
        run = _checkpointed if self.checkpoint_blocks else _plain
        for i, layer in enumerate(self.layers):
            # each block reads its own exact copy (x * 1) of the shared inputs, so their gradient is
            # summed per block first whether or not the block is checkpointed: bit-identical both ways
            h = run(layer, h, context * 1, adaln * 1, rope, local_cond, key_mask)
            _put(capture, **{f"block_{i}_out": h})
        out = self.project_out(h[:, self.num_memory_tokens :])
        _put(capture, project_out_out=out)
        return out


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        C, E = cfg.io_channels, cfg.embed_dim
        self.config = cfg
        self.preprocess_conv = nn.Conv1d(C, C, kernel_size=1, bias=False)
        self.postprocess_conv = nn.Conv1d(C, C, kernel_size=1, bias=False)
        self.to_cond_embed = _mlp(cfg.cond_token_dim, E, bias=False)
        self.to_global_embed = _mlp(cfg.global_cond_dim, E, bias=False)
        self.to_timestep_embed = _mlp(cfg.timestep_features_dim, E, bias=True)
        self.transformer = ContinuousTransformer(cfg)
        self._timestep_freqs = mx.array(expo_frequencies(cfg.timestep_features_dim))  # "_": not a parameter

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the DiT computes in (fp32 on the CPU even for a base kept in fp16)."""
        return compute_dtype(self.transformer.project_in.weight.dtype)

    def __call__(
        self,
        x: mx.array,
        t: mx.array,
        cross_attn_cond: mx.array,
        global_cond: mx.array,
        local_add_cond: mx.array | None = None,
        capture: dict | None = None,
        padding_mask: mx.array | None = None,
    ) -> mx.array:
        """Velocity [B,C,T]. `capture`, if given, receives the intermediates of the fixtures.
        `padding_mask` [B,T] (True = real audio; default None = off) zeroes the self-attention
        values at padded frames (the official `mask_padding_attention` without flash-attn)."""
        dtype = self.dtype
        features = expo_fourier_features(t, self._timestep_freqs)  # fp32 whatever the model dtype
        t_embed = _run_mlp(self.to_timestep_embed, features.astype(dtype))
        g_proj = _run_mlp(self.to_global_embed, global_cond.astype(dtype))
        context = _run_mlp(self.to_cond_embed, cross_attn_cond.astype(dtype))
        _put(capture, timestep_features=features, timestep_embed=t_embed, global_embed_proj=g_proj, cond_embed=context)
        h = x.astype(dtype).transpose(0, 2, 1)
        h = self.preprocess_conv(h) + h
        local = None if local_add_cond is None else local_add_cond.astype(dtype).transpose(0, 2, 1)
        out = self.transformer(h, context, g_proj + t_embed, local, capture, padding_mask)
        out = self.postprocess_conv(out) + out
        return out.transpose(0, 2, 1)


def _plain(layer: TransformerBlock, *args) -> mx.array:
    return layer(*args)


def _checkpointed(layer: TransformerBlock, x, context, adaln, rope, local_cond, key_mask) -> mx.array:
    """The block with its forward recomputed in the backward. Trainable tensors (the adapters), x,
    context and adaln are the differentiated inputs; the rest are constants. The recompute waits
    for the block's output gradient (`mx.depends`), so no block's internals are alive before the
    backward reaches it (`mx.checkpoint` only waits for the forward). It reads the frozen weights and
    the constants through `mx.depends` as well: otherwise `mx.compile` merges the recompute's work on
    them (the local embedding, casts of an fp16 base) with the forward's and keeps the forward's
    results alive until the backward. Same operations, same numbers."""
    trainable = tree_flatten(layer.trainable_parameters())
    names, values = [k for k, _ in trainable], [v for _, v in trainable]
    frozen = [(k, v) for k, v in tree_flatten(layer.parameters()) if k not in set(names)]
    constants = [*rope, local_cond, key_mask]

    def block(*arrays: mx.array, constants=constants) -> mx.array:
        layer.update(tree_unflatten(list(zip(names, arrays[: len(names)]))))
        cos, sin, local, mask = constants
        return layer(*arrays[len(names) :], (cos, sin), local, mask)

    run = mx.custom_function(block)

    @run.vjp
    def recompute(primals, cotangent, output):
        present = [c for c in constants if c is not None]
        fresh = mx.depends([*primals, *(v for _, v in frozen), *present], [cotangent])
        primals, fresh = fresh[: len(primals)], fresh[len(primals) :]
        layer.update(tree_unflatten([(k, fresh[i]) for i, (k, _) in enumerate(frozen)]))
        fresh_constants = iter(fresh[len(frozen) :])
        again = [None if c is None else next(fresh_constants) for c in constants]
        _, grads = mx.vjp(lambda *a: block(*a, constants=again), primals, [cotangent])
        layer.update(tree_unflatten(frozen))
        # the gradients flowing on wait for this block's adapter gradients, so those are computed
        # (and the recomputed activations freed) now, not at the end of the backward
        params, inputs = grads[: len(names)], grads[len(names) :]
        return (*params, *(mx.depends(inputs, params) if params else inputs))

    out = run(*values, x, context, adaln)
    layer.update(tree_unflatten(list(zip(names, values))))  # the traced call left its own copies in the layer
    return out


def _put(capture: dict | None, **values) -> None:
    if capture is not None:
        capture.update(values)


def compiled_forward(dit: DiT) -> Callable:
    """`mx.compile`d DiT call for fixed shapes: f(x, t, cross_attn_cond, global_cond[, local_add_cond]).

    The weights are compile inputs (`dit.state`), so weight updates are seen without recompiling.
    """
    compiled = mx.compile(lambda *arrays: dit(*arrays), inputs=dit.state)
    seen = set()

    def call(*arrays):
        shapes = tuple(None if a is None else (a.shape, a.dtype) for a in arrays)
        if shapes in seen:
            return compiled(*arrays)
        seen.add(shapes)
        with compile_notice("the DiT forward", *(a for a in arrays if a is not None)):
            out = compiled(*arrays)
            mx.eval(out)  # the compile happens here, inside the notice
        return out

    return call
