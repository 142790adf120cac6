"""A bounded LRU cache of raw T5Gemma outputs, one entry per prompt.

Entries are the encoder's output *before* padding substitution (base and ARC checkpoints carry
different padding embeddings but share the encoder), keyed by (encoder weights id, max_length,
exact prompt string). Bounded both by entry count and by bytes; counts hits and misses.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB ≈ 1300 prompts at 256×768 fp32


class PromptKey(NamedTuple):
    weights_id: str
    max_length: int
    prompt: str


@dataclass(frozen=True)
class CachedPrompt:
    hidden: np.ndarray  # [L, H] raw encoder output (own buffer, so its bytes are exact)
    mask: np.ndarray  # [L] bool, True = real token

    @property
    def nbytes(self) -> int:
        return int(self.hidden.nbytes) + int(self.mask.nbytes)


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class PromptCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must be non-negative")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[PromptKey, CachedPrompt] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: PromptKey) -> CachedPrompt | None:
        """The entry (now most recently used), or None; counts a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: PromptKey, entry: CachedPrompt) -> None:
        """Insert (or refresh) an entry, then evict least recently used ones past either bound.

        An entry larger than the byte bound on its own is not kept.
        """
        if key in self._entries:
            self._bytes -= self._entries.pop(key).nbytes
        if entry.nbytes > self.max_bytes or self.max_entries == 0:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.evictions += 1

    def __contains__(self, key: PromptKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, self.evictions, len(self._entries), self._bytes)

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._entries.clear()
        self._bytes = 0
