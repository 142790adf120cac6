"""Prompt tokenisation as the official conditioner does it:
`tok(prompts, padding="max_length", truncation=True, max_length=L)` on the encoder folder's own
tokenizer. `tokenizer.json` is read with the `tokenizers` library (what HF's fast tokenizer wraps);
its post-processor decides which special tokens are added, nothing is added or stripped here.
A folder with only `tokenizer.model` needs the optional `sentencepiece` package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sa3mlx.runtime.artifacts import read_json
from sa3mlx.runtime.errors import ArtifactError, UserError, one_line


class TokenizerError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Tokens:
    input_ids: np.ndarray  # [B, L] int32
    attention_mask: np.ndarray  # [B, L] bool, True = real token


class PromptTokenizer:
    """Fixed-length tokenisation: right-truncate to L, pad to L with `pad_id`."""

    def __init__(self, backend, max_length: int, pad_id: int, name: str):
        self.backend, self.max_length, self.pad_id, self.name = backend, max_length, pad_id, name

    @classmethod
    def from_folder(cls, folder: str | Path, max_length: int, pad_id: int) -> PromptTokenizer:
        folder = Path(folder)
        if max_length < 1:
            raise TokenizerError(f"max_length must be positive, got {max_length}")
        sides = _sides(folder)
        if (folder / "tokenizer.json").is_file():
            return cls(
                _HFJsonBackend(folder / "tokenizer.json", max_length, pad_id, **sides),
                max_length,
                pad_id,
                str(folder / "tokenizer.json"),
            )
        if (folder / "tokenizer.model").is_file():
            if sides["padding_side"] != "right" or sides["truncation_side"] != "right":
                raise TokenizerError(f"{folder}: only right padding/truncation is supported for tokenizer.model")
            return cls(
                _SentencePieceBackend(folder / "tokenizer.model"), max_length, pad_id, str(folder / "tokenizer.model")
            )
        raise TokenizerError(f"{folder}: no tokenizer.json or tokenizer.model")

    def __call__(self, prompts: list[str] | str) -> Tokens:
        if isinstance(prompts, str):
            prompts = [prompts]
        rows = [self.backend.encode(p) for p in prompts]
        L = self.max_length
        ids = np.full((len(rows), L), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(rows), L), dtype=bool)
        for b, (row_ids, row_mask) in enumerate(rows):
            if len(row_ids) != L:
                row_ids, row_mask = _fit(row_ids, row_mask, L, self.pad_id)
            ids[b], mask[b] = row_ids, row_mask
        return Tokens(ids, mask)


def _sides(folder: Path) -> dict[str, str]:
    config = folder / "tokenizer_config.json"
    data = read_json(config, "tokenizer config") if config.is_file() else {}
    sides = {name: data.get(name, "right") for name in ("padding_side", "truncation_side")}
    for name, side in sides.items():
        if side not in ("left", "right"):
            raise ArtifactError(config, f"damaged tokenizer config ({name} {side!r}: expected left or right)")
    return sides


def _fit(ids, mask, length: int, pad_id: int):
    """Right-truncate / right-pad (used by backends that do not pad themselves)."""
    ids, mask = list(ids)[:length], list(mask)[:length]
    pad = length - len(ids)
    return ids + [pad_id] * pad, mask + [0] * pad


class _HFJsonBackend:
    """`tokenizers` configured like HF's fast tokenizer for this call (post-processor untouched)."""

    def __init__(self, path: Path, max_length: int, pad_id: int, padding_side: str, truncation_side: str):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a damaged file
            raise ArtifactError(path, f"damaged tokenizer ({one_line(e)})") from e
        pad_token = self.tok.id_to_token(pad_id)
        if pad_token is None:
            raise TokenizerError(f"{path}: pad id {pad_id} is not in the vocabulary")
        self.tok.enable_truncation(max_length=max_length, stride=0, strategy="longest_first", direction=truncation_side)
        self.tok.enable_padding(
            direction=padding_side, pad_id=pad_id, pad_type_id=0, pad_token=pad_token, length=max_length
        )

    def encode(self, prompt: str):
        enc = self.tok.encode(prompt, add_special_tokens=True)
        return enc.ids, enc.attention_mask


class _SentencePieceBackend:
    """`tokenizer.model` with sentencepiece: plain `Encode` (no BOS/EOS), then right truncation/padding."""

    def __init__(self, path: Path):
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerError(
                f"{path.parent}: only tokenizer.model is present and the optional `sentencepiece` package "
                "is not installed; add the folder's tokenizer.json, or `pip install sentencepiece`"
            ) from None
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))

    def encode(self, prompt: str):
        ids = self.sp.encode(prompt)
        return ids, [1] * len(ids)
