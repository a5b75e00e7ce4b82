"""Token ids of long texts seen before, so a repeated chunk (a RAG passage, an agent's system prompt, the
earlier turns of a chat) is not tokenized again on every request.

Tokenizing is deterministic, so a hit returns exactly what tokenizing would; it only saves time, which matters
once a warm prefill is short enough for tokenizing a long message to show. One LRU per tokenizer
object (held weakly, so a dropped tokenizer takes its entries with it), bounded by the tokens it holds;
short texts are not cached (they tokenize in microseconds)."""

from __future__ import annotations

import threading
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

MIN_CACHED_CHARS = 512
DEFAULT_MAX_TOKENS = 1 << 20  # ≈8 MiB of token ids per tokenizer


@dataclass
class TokenCacheStats:
    hits: int = 0
    misses: int = 0
    tokens: int = 0  # token ids held now
    entries: int = 0


class TokenCache:
    """text -> token ids, least recently used first out once more than max_tokens are held."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = TokenCacheStats()

    def get_or_encode(self, text: str, encode: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
                self.stats.hits += 1
                return tuple(ids)
            self.stats.misses += 1
        tokens = encode(text)  # outside the lock: the slow part
        if len(tokens) <= self.max_tokens:
            with self._lock:
                if text not in self._entries:
                    self._entries[text] = array("q", tokens)
                    self.stats.tokens += len(tokens)
                while self.stats.tokens > self.max_tokens:
                    _, old = self._entries.popitem(last=False)
                    self.stats.tokens -= len(old)
                self.stats.entries = len(self._entries)
        return tokens


_caches: "weakref.WeakKeyDictionary[Any, TokenCache]" = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def cache_for(tokenizer: Any) -> TokenCache | None:
    """The tokenizer's cache (created on first use); None for an object that cannot be weakly referenced."""
    with _caches_lock:
        try:
            cache = _caches.get(tokenizer)
            if cache is None:
                cache = _caches[tokenizer] = TokenCache()
        except TypeError:
            return None
    return cache
