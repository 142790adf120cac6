"""T5Gemma prompt-encoder throughput at the real google/t5gemma-b-b-ul2 sizes, random weights.

    python bench/t5gemma.py [--batches 1 8] [--length 256] [--repeats 3] [--storage float16]

Prints, per batch size, the median seconds per encoder call on full-length prompts and the
resulting prompts per second, then the median time of a fully cached lookup of the same batch
through `PromptEncoder` (tokenise nothing new, stack cached rows) and its speed-up.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import sa3mlx  # noqa: F401  (BLAS set-up before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from blas import median_seconds  # bench/blas.py: the shared timing helper

from sa3mlx.convert.t5gemma import t5gemma_shapes
from sa3mlx.models.config import T5GemmaConfig
from sa3mlx.models.prompt import PromptEncoder
from sa3mlx.models.prompt_cache import PromptCache
from sa3mlx.models.t5gemma import t5gemma_from_arrays
from sa3mlx.models.tokenizer import PromptTokenizer
from sa3mlx.runtime.precision import compute_dtype, parse_dtype

ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = ROOT / "models" / "tiny-base" / "t5gemma-b-b-ul2"
REAL = T5GemmaConfig(  # google/t5gemma-b-b-ul2, encoder half
    vocab_size=256_000,
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=12,
    head_dim=64,
    intermediate_size=2048,
    query_pre_attn_scalar=64.0,
    attn_logit_softcapping=50.0,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    layer_types=("sliding_attention", "full_attention") * 6,
    sliding_window=4096,
    pad_token_id=0,
)


def random_encoder(storage: mx.Dtype):
    arrays = {}
    for i, (name, shape) in enumerate(sorted(t5gemma_shapes(REAL).items())):
        scale = 0.1 if len(shape) == 1 else shape[-1] ** -0.5
        arrays[name] = (mx.random.normal(shape, key=mx.random.key(i)) * scale).astype(storage)
    return t5gemma_from_arrays(arrays, REAL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--storage", default="float16")
    args = parser.parse_args()

    storage = parse_dtype(args.storage)
    model = random_encoder(storage)
    print(
        f"device {mx.default_device()}, storage {args.storage}, compute {compute_dtype(storage)}, "
        f"{REAL.num_layers} layers x {REAL.hidden_size}, vocab {REAL.vocab_size}, L={args.length}"
    )
    rng = np.random.default_rng(0)
    tokenizer = PromptTokenizer.from_folder(TINY_TOKENIZER, args.length, REAL.pad_token_id)
    for batch in args.batches:
        ids = mx.array(rng.integers(4, REAL.vocab_size, (batch, args.length), dtype=np.int32))
        mask = mx.ones((batch, args.length), dtype=mx.bool_)
        seconds = median_seconds(lambda: mx.eval(model(ids, mask)), args.repeats)
        print(f"batch {batch}: encode {seconds * 1e3:9.1f} ms/call  {batch / seconds:7.2f} prompts/s")

        encoder = PromptEncoder(model, tokenizer, "bench", PromptCache())
        prompts = [f"dark techno loop {b}" for b in range(batch)]
        encoder(prompts)  # fill the cache
        cached = median_seconds(lambda: mx.eval(*encoder(prompts)), max(args.repeats, 20))
        print(
            f"batch {batch}: cached {cached * 1e3:9.3f} ms/call  {seconds / cached:7.0f}x faster "
            f"(hit rate {encoder.cache.stats().hit_rate:.2f})"
        )


if __name__ == "__main__":
    main()
