"""Fetch a block only where that beats recomputing it: both rates are measured while serving.

Recomputing costs the engine's measured prefill time per token (steps that prefill, moving average) times
the block's tokens. Fetching costs the tier's measured seconds per block (its reads, moving average, the
round trip of a batched read spread over the blocks it returned). Until a rate has been measured, fetching
is tried: that is how it gets measured. On a fast GPU a slow tier can stop being used; on a CPU, where
prefill is slow, every tier tends to win (BENCHMARKS.md, KV tiers).

A declined tier is read anyway once every REMEASURE_EVERY declines: its rate was measured at one moment (a
busy machine, a slow network), and without a new read it would never be measured again, so one slow moment
would switch the tier off for good. `always` (--tier-fetch always) reads every block a tier holds."""
from __future__ import annotations

ALPHA = 0.2  # weight of the newest measurement
REMEASURE_EVERY = 16  # declined lookups of a tier between two reads that measure it again


class FetchCosts:
    def __init__(self, block_size: int, always: bool = False):
        self.block_size = block_size
        self.always = always
        self.prefill_seconds_per_token: float | None = None
        self.seconds_per_block: dict[str, float] = {}
        self.declines: dict[str, int] = {}  # consecutive declines per tier

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
        if self.always or fetch is None or recompute is None or fetch < recompute:
            self.declines[tier] = 0
            return True
        self.declines[tier] = self.declines.get(tier, 0) + 1
        if self.declines[tier] >= REMEASURE_EVERY:  # read once more, to measure the tier again
            self.declines[tier] = 0
            return True
        return False
