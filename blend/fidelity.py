"""The fidelity check of blending: is a reused chunk's KV close enough to what this prompt computes?

A chunk's cached KV was computed after other text (or none). Where the new context changes it a lot (text
that means something else here, a chunk spliced from unrelated texts, short repetitive text whose every
token attends to something else, KV damaged in a tier), reusing it blends garbage; the selection budget
then fixes only its worst tokens. At the first check layer every reused token is computed anyway (CacheBlend
needs its fresh K/V to choose), so the stale and fresh K/V of each chunk are both on hand and the check costs
no extra forward: the chunk's relative deviation

    sqrt(sum |K_fresh - K_reused|^2 / sum |K_fresh|^2)   over the chunk's tokens (likewise V),

the larger of its K and V terms, is compared with --blend-max-deviation; a chunk above it is rejected, and
all its tokens are recomputed in every later layer, on top of the selection's budget. The sums accumulate
over the prompt's slices, so a chunk a slice boundary cuts is judged on all of it seen so far.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where sums are taken: the engine's config checks the threshold without it
    import torch

# K and V terms of one chunk: squared deviation, squared fresh norm
_TERMS = 4


@dataclass(frozen=True)
class FidelityCheck:
    """max_deviation: the largest relative deviation a reused chunk may show; inf turns the check off (every
    chunk found is reused, as before the check existed), 0 rejects every chunk that deviates at all (in
    practice all of them: blending then recomputes everything it copied in, a full prefill's answer)."""

    max_deviation: float = math.inf

    def __post_init__(self):
        if math.isnan(self.max_deviation) or self.max_deviation < 0:
            raise ValueError(f"max_deviation must be >= 0 (inf: off), got {self.max_deviation}")

    @property
    def active(self) -> bool:
        return math.isfinite(self.max_deviation)


class ChunkDeviation:
    """Per-chunk sums of one blended prompt's stale-vs-fresh K/V differences, added slice by slice."""

    def __init__(self, num_chunks: int):
        import torch

        self.sums = torch.zeros(num_chunks, _TERMS, dtype=torch.float64)

    def add(self, chunk_ids: torch.Tensor, old_k: torch.Tensor, new_k: torch.Tensor, old_v: torch.Tensor,
            new_v: torch.Tensor) -> None:
        """chunk_ids [N] (int64, host): the chunk of each of N tokens whose stale (old_*) and fresh (new_*) K/V
        [N, kv_heads, head_dim] are given."""
        import torch

        terms = torch.stack([_row_sq(new_k - old_k.to(new_k.dtype)), _row_sq(new_k),
                             _row_sq(new_v - old_v.to(new_v.dtype)), _row_sq(new_v)], dim=1)
        self.sums.index_add_(0, chunk_ids, terms.cpu().double())

    def relative(self) -> torch.Tensor:
        """[chunks, 2]: each chunk's relative K and V deviation (0 where nothing was added)."""
        import torch

        dev, norm = self.sums[:, 0::2], self.sums[:, 1::2]
        return torch.where(norm > 0, (dev / norm.clamp_min(1e-30)).sqrt(), torch.zeros_like(dev))

    def deviation(self) -> torch.Tensor:
        """[chunks]: the larger of each chunk's relative K and V deviation."""
        return self.relative().amax(dim=1)


def _row_sq(x: torch.Tensor) -> torch.Tensor:
    return x.float().square().reshape(x.shape[0], -1).sum(dim=1)
