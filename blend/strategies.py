"""Which reused tokens a blended prefill recomputes: one type per method from the literature.

- ``Deviation`` (CacheBlend, arXiv 2405.16444): every reused token is computed up to a check layer, where
  the ones whose fresh KV deviates most from the reused KV are kept for the later layers. Selection costs
  those first layers over every reused token.
- ``ChunkStarts`` (EPIC's LegoLink, arXiv 2410.15332): a chunk cached alone turns its first tokens into an
  attention sink that misleads the text after it; only each reused chunk's first tokens are recomputed, at
  every layer, and no other reused token is computed anywhere ("static sparsity": nothing is computed to
  decide, which is where EPIC's speed over CacheBlend comes from).
- ``QuestionAttention`` (A³, arXiv 2511.17560): the question (the prompt after the last reused chunk) is run
  once over the reused KV; the reused tokens it attends to most are recomputed at every layer, the others at
  none. The recomputed tokens are then the context the answer reads, not the ones that deviate most.

All three spend the same budget, ceil(recompute ratio * reused tokens), unless ``ChunkStarts`` is given a
fixed count per chunk (EPIC's k), so they can be compared at equal recompute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # torch is imported where a mask is built: the engine's config names a strategy without it
    import torch


class Selection:
    """A selection strategy; its ``key`` names everything about it that changes the KV blending produces."""

    name: ClassVar[str]
    # chooses before the forward (every layer then computes the same rows), or at check layers
    static: ClassVar[bool]
    # needs the question's attention over the reused KV (a probe pass before the prefill)
    reads_question: ClassVar[bool] = False

    def key(self) -> str:
        return self.name


@dataclass(frozen=True)
class Deviation(Selection):
    """CacheBlend. query_weight > 0 adds the question's attention (scaled to mean 1, times the weight) to
    the deviation score: a hybrid that still pays the check layers."""

    query_weight: float = 0.0
    name: ClassVar[str] = "cacheblend"
    static: ClassVar[bool] = False

    def __post_init__(self):
        if math.isnan(self.query_weight) or self.query_weight < 0:
            raise ValueError(f"query_weight must be >= 0, got {self.query_weight}")

    @property
    def reads_question(self) -> bool:  # type: ignore[override]
        return self.query_weight > 0

    def key(self) -> str:
        return f"{self.name}:q={self.query_weight:g}"


@dataclass(frozen=True)
class ChunkStarts(Selection):
    """EPIC. first_tokens: k tokens recomputed at the start of every reused chunk (EPIC's fixed k); 0 spends
    the recompute ratio's budget instead, spread evenly over the reused chunks."""

    first_tokens: int = 0
    name: ClassVar[str] = "epic"
    static: ClassVar[bool] = True

    def __post_init__(self):
        if self.first_tokens < 0:
            raise ValueError(f"first_tokens must be >= 0, got {self.first_tokens}")

    def key(self) -> str:
        return f"{self.name}:k={self.first_tokens}"

    def per_chunk(self, chunk_lens: list[int], budget: int) -> list[int]:
        """How many first tokens of each chunk (of these lengths) to recompute."""
        if self.first_tokens:
            return [min(self.first_tokens, n) for n in chunk_lens]
        return spread(budget, chunk_lens)

    def mask(self, chunk_starts: list[int], chunk_lens: list[int], budget: int, total: int) -> torch.Tensor:
        """Bool [total]: the first tokens of each chunk (prompt positions chunk_starts, lengths chunk_lens)."""
        from blend.selection import first_tokens_mask

        return first_tokens_mask(chunk_starts, chunk_lens, self.per_chunk(chunk_lens, budget), total)


@dataclass(frozen=True)
class QuestionAttention(Selection):
    """A³: the budget goes to the reused tokens the question's probe pass attends to most."""

    name: ClassVar[str] = "a3"
    static: ClassVar[bool] = True
    reads_question: ClassVar[bool] = True

    @staticmethod
    def mask(attention: torch.Tensor, reused: torch.Tensor, budget: int) -> torch.Tensor:
        """Bool like `reused`: the `budget` reused tokens with the most attention (ties to the earlier)."""
        from blend.selection import select_top_k

        cand = reused.nonzero(as_tuple=True)[0]
        chosen = reused.new_zeros(reused.shape)
        chosen[cand[select_top_k(attention[cand].float(), budget)]] = True
        return chosen


SELECTIONS = {"cacheblend": Deviation, "epic": ChunkStarts, "a3": QuestionAttention}


def spread(budget: int, sizes: list[int]) -> list[int]:
    """Split `budget` as evenly as the sizes allow: each part gets the same share, capped by its size, what a
    cap leaves goes to the parts still below theirs, and a remainder to the earliest of them."""
    if budget < 0 or any(n < 0 for n in sizes):
        raise ValueError("budget and sizes must be >= 0")
    out = [0] * len(sizes)
    left = min(budget, sum(sizes))
    while left:
        open_ = [i for i, n in enumerate(sizes) if out[i] < n]
        share = left // len(open_)
        if share == 0:  # fewer tokens left than parts: one each, earliest first
            for i in open_[:left]:
                out[i] += 1
            break
        for i in open_:
            take = min(share, sizes[i] - out[i])
            out[i] += take
            left -= take
    return out


def make_selection(name: str, first_tokens: int = 0, query_weight: float = 0.0) -> Selection:
    """The strategy the server's flags name; a parameter of another strategy is an error, not ignored."""
    if name not in SELECTIONS:
        raise ValueError(f"unknown blend selection {name!r}; choose one of {', '.join(SELECTIONS)}")
    if first_tokens and name != ChunkStarts.name:
        raise ValueError(f"blend first tokens (EPIC's k) need the {ChunkStarts.name!r} selection, not {name!r}")
    if query_weight and name != Deviation.name:
        raise ValueError(f"blend query weight (weighing the question's attention into the deviation) needs the "
                         f"{Deviation.name!r} selection, not {name!r}")
    if name == ChunkStarts.name:
        return ChunkStarts(first_tokens)
    if name == Deviation.name:
        return Deviation(query_weight)
    return QuestionAttention()
