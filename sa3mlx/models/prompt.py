"""Prompt strings -> raw T5Gemma hidden states and their mask (tokenizer + encoder + cache).

The padding substitution (`padding_embedding`) and the assembly with the seconds token happen
downstream in `conditioning.py`; this returns the encoder output before either.

Empty prompts: an all-padding row masks every key with the dtype minimum, so its attention is
uniform over the row instead of NaN (HF's behaviour, which the fixtures record); the row is
replaced by the padding embedding downstream anyway.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.models.config import ModelConfig, T5GemmaConfig
from sa3mlx.models.prompt_cache import CachedPrompt, PromptCache, PromptKey
from sa3mlx.models.t5gemma import T5GemmaEncoder, load_t5gemma
from sa3mlx.models.tokenizer import PromptTokenizer
from sa3mlx.runtime.io import sha256_file
from sa3mlx.runtime.layout import MANIFEST_FILE, MODEL_CONFIG_FILE, T5GEMMA_FILE

TEXT_FOLDER = "t5gemma"
# Misses are encoded one prompt per call: batched GEMMs round differently with the batch
# composition, and a prompt's embedding must not depend on its neighbours (bit-exact resume).
ENCODE_BATCH = 1


class PromptEncoder:
    def __init__(
        self, encoder: T5GemmaEncoder, tokenizer: PromptTokenizer, weights_id: str, cache: PromptCache | None = None
    ):
        self.encoder, self.tokenizer, self.weights_id, self.cache = encoder, tokenizer, weights_id, cache

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    @classmethod
    def from_converted(
        cls, folder: str | Path, max_length: int | None = None, cache: PromptCache | None = None
    ) -> PromptEncoder:
        """A converted model folder (`t5gemma.npz`, `t5gemma/`); max_length from its model_config.json."""
        folder = Path(folder)
        text_dir = folder / TEXT_FOLDER
        config = T5GemmaConfig.load(text_dir)
        if max_length is None:
            max_length = ModelConfig.load(folder / MODEL_CONFIG_FILE).conditioner.prompt.max_length
        encoder = load_t5gemma(folder / T5GEMMA_FILE, config)
        tokenizer = PromptTokenizer.from_folder(text_dir, max_length, config.pad_token_id)
        return cls(encoder, tokenizer, weights_id(folder / T5GEMMA_FILE), cache)

    def encode_tokens(self, input_ids, attention_mask) -> mx.array:
        """Token ids [B,L] + mask [B,L] -> raw last hidden state [B,L,H] fp32 (no cache)."""
        ids = mx.array(np.asarray(input_ids, dtype=np.int32))
        mask = mx.array(np.asarray(attention_mask).astype(bool))
        hidden = self.encoder(ids, mask).astype(mx.float32)
        mx.eval(hidden)
        return hidden

    def __call__(self, prompts: list[str] | str) -> tuple[mx.array, mx.array]:
        """Prompts -> (hidden [B,L,H] fp32, mask [B,L] bool), encoding each distinct prompt once."""
        if isinstance(prompts, str):
            prompts = [prompts]
        found = {p: self._lookup(p) for p in dict.fromkeys(prompts)}
        missing = [p for p, entry in found.items() if entry is None]
        for start in range(0, len(missing), ENCODE_BATCH):
            chunk = missing[start : start + ENCODE_BATCH]
            tokens = self.tokenizer(chunk)
            hidden = np.array(self.encode_tokens(tokens.input_ids, tokens.attention_mask))
            for row, prompt in enumerate(chunk):
                found[prompt] = CachedPrompt(hidden[row].copy(), tokens.attention_mask[row].copy())
                if self.cache is not None:
                    self.cache.put(self._key(prompt), found[prompt])
        hidden = np.stack([found[p].hidden for p in prompts])
        mask = np.stack([found[p].mask for p in prompts])
        return mx.array(hidden), mx.array(mask)

    def _key(self, prompt: str) -> PromptKey:
        return PromptKey(self.weights_id, self.max_length, prompt)

    def _lookup(self, prompt: str) -> CachedPrompt | None:
        return self.cache.get(self._key(prompt)) if self.cache is not None else None


def weights_id(npz_path: str | Path) -> str:
    """Content id of the encoder weights: the manifest's sha256 when convert wrote one, else hashed."""
    path = Path(npz_path)
    manifest = path.parent / MANIFEST_FILE
    if manifest.is_file():
        entry = json.loads(manifest.read_text()).get("files", {}).get(path.name, {})
        if entry.get("sha256"):
            return entry["sha256"]
    return sha256_file(path)
