"""Token-eviction policies, and what their evictions give back to a paged KV pool.

A policy keeps a budget of a sequence's tokens (one kept set for every layer and head: a paged pool returns a
block only when no layer needs any of its slots) and evicts the rest:
- streaming (StreamingLLM): the first `sinks` tokens (attention sinks) and the most recent ones;
- h2o (H2O): the most recent tokens (`recent_share` of the budget) and the heavy hitters, the earlier tokens
  that received the most attention, accumulated over queries, heads and layers.

Evicting a token frees memory only when every slot of its block is evicted: `blocks_freed` counts those
blocks. The sequence's last token (the query) is always kept."""

from __future__ import annotations

import numpy as np

POLICIES = ("streaming", "h2o")


def budget(num_tokens: int, keep_ratio: float) -> int:
    """Tokens kept at a keep ratio: at least the last one."""
    if not 0.0 <= keep_ratio <= 1.0:
        raise ValueError(f"keep ratio {keep_ratio} is not in [0, 1]")
    return min(num_tokens, max(1, round(keep_ratio * num_tokens)))


def streaming_keep(num_tokens: int, keep: int, sinks: int) -> np.ndarray:
    """Kept mask: the first min(sinks, keep - 1) tokens and the last keep - that many."""
    kept = np.zeros(num_tokens, dtype=bool)
    first = min(sinks, keep - 1)
    kept[:first] = True
    kept[num_tokens - (keep - first):] = True
    return kept


def h2o_keep(scores: np.ndarray, keep: int, recent_share: float) -> np.ndarray:
    """Kept mask: the last max(1, recent_share x keep) tokens, then the highest-scoring earlier tokens
    (ties to the earlier position) until `keep` are kept."""
    num_tokens = len(scores)
    recent = min(keep, max(1, round(recent_share * keep)))
    kept = np.zeros(num_tokens, dtype=bool)
    kept[num_tokens - recent:] = True
    older = num_tokens - recent
    heavy = np.argsort(-np.asarray(scores[:older], dtype=np.float64), kind="stable")[: keep - recent]
    kept[heavy] = True
    return kept


def kept_tokens(policy: str, keep_ratio: float, scores: np.ndarray, sinks: int = 4,
                recent_share: float = 0.5) -> np.ndarray:
    """The kept mask of `policy` over len(scores) tokens (scores: accumulated attention per token)."""
    keep = budget(len(scores), keep_ratio)
    if policy == "streaming":
        return streaming_keep(len(scores), keep, sinks)
    if policy == "h2o":
        return h2o_keep(scores, keep, recent_share)
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def blocks_freed(kept: np.ndarray, block_size: int) -> tuple[int, int]:
    """(blocks whose every token is evicted, blocks the sequence occupies). A partly filled last block
    counts its empty slots as in use: it is never returned while the sequence lives."""
    if block_size < 1:
        raise ValueError(f"the block size must be at least 1, got {block_size}")
    blocks = -(-len(kept) // block_size)
    padded = np.ones(blocks * block_size, dtype=bool)
    padded[: len(kept)] = kept
    return int((~padded.reshape(blocks, block_size).any(axis=1)).sum()), blocks
