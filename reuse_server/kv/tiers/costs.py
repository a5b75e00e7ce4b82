"""Fetch a block only where that beats recomputing it: both rates are measured while serving.

Recomputing costs the engine's measured prefill time per token (steps that prefill, moving average) times
the block's tokens. Fetching costs the tier's measured seconds per block (its reads, moving average, the
round trip of a batched read spread over the blocks it returned). Until a rate has been measured, fetching
is tried: that is how it gets measured. On a fast GPU a slow tier can stop being used; on a CPU, where
prefill is slow, every tier tends to win (BENCHMARKS.md, KV tiers)."""
from __future__ import annotations

ALPHA = 0.2  # weight of the newest measurement


class FetchCosts:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.prefill_seconds_per_token: float | None = None
        self.seconds_per_block: dict[str, float] = {}

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else (1 - ALPHA) * old + ALPHA * new

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_seconds_per_token = self._average(self.prefill_seconds_per_token, seconds / tokens)

    def observe_read(self, tier: str, blocks: int, seconds: float) -> None:
        if blocks > 0:
            self.seconds_per_block[tier] = self._average(self.seconds_per_block.get(tier), seconds / blocks)

    def recompute_seconds(self) -> float | None:
        per_token = self.prefill_seconds_per_token
        return None if per_token is None else per_token * self.block_size

    def worth_fetching(self, tier: str) -> bool:
        fetch, recompute = self.seconds_per_block.get(tier), self.recompute_seconds()
        return fetch is None or recompute is None or fetch < recompute
