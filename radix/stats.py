"""Counters of the cache index, as a plain object for metrics."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    """Block counts right now, and cumulative query/hit/eviction counters.

    Queries and hits are counted in tokens, the way vLLM's `prefix_cache_queries` and
    `prefix_cache_hits` are (a query counts the whole prompt, partial last block included);
    evictions in blocks. `free_blocks + evictable_blocks + in_use_blocks == total_blocks`.
    """

    total_blocks: int
    free_blocks: int
    evictable_blocks: int
    in_use_blocks: int
    cached_blocks: int  # blocks held by the tree (evictable + locked)
    cached_tokens: int  # tokens whose KV those blocks hold (full blocks, and the tokens of tails)
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int
    pinned_blocks: int = 0  # of in_use_blocks, tree blocks kept by prompt-cache pins (RadixCache.pin)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
