"""The selection strategies' own rules: how EPIC spreads a budget over chunks, which flags name which type."""
from __future__ import annotations

import pytest
import torch

from blend.strategies import ChunkStarts, Deviation, QuestionAttention, make_selection, spread


@pytest.mark.parametrize("budget, sizes, want", [
    (13, [11, 13, 18], [5, 4, 4]),     # the remainder to the earliest chunks
    (12, [2, 20, 20], [2, 5, 5]),      # what a short chunk cannot take goes to the others
    (100, [3, 4], [3, 4]),             # never more than the chunks hold
    (2, [5, 5, 5], [1, 1, 0]),
    (0, [5, 5], [0, 0]),
    (7, [], []),
])
def test_spread(budget, sizes, want):
    got = spread(budget, sizes)
    assert got == want and sum(got) == min(budget, sum(sizes))


def test_epic_masks_each_chunks_first_tokens():
    fixed = ChunkStarts(first_tokens=2).mask([1, 6], [3, 4], budget=99, total=11)
    assert fixed.nonzero().flatten().tolist() == [1, 2, 6, 7]
    by_ratio = ChunkStarts().mask([1, 6], [3, 4], budget=5, total=11)
    assert by_ratio.nonzero().flatten().tolist() == [1, 2, 3, 6, 7]


def test_a3_takes_the_most_attended_reused_tokens():
    attention = torch.tensor([9.0, 0.1, 0.5, 0.3, 0.7, 5.0])
    reused = torch.tensor([False, True, True, True, True, False])  # 0 and 5 are not reused: never chosen
    assert QuestionAttention.mask(attention, reused, 2).nonzero().flatten().tolist() == [2, 4]


def test_flags_name_one_type_and_refuse_another_types_parameter():
    assert make_selection("cacheblend", query_weight=1.0) == Deviation(1.0)
    assert make_selection("epic", first_tokens=4) == ChunkStarts(4)
    assert make_selection("a3") == QuestionAttention()
    with pytest.raises(ValueError, match="need the 'epic' selection"):
        make_selection("a3", first_tokens=4)
    with pytest.raises(ValueError, match="needs the 'cacheblend' selection"):
        make_selection("epic", query_weight=1.0)
    with pytest.raises(ValueError, match="unknown blend selection"):
        make_selection("sparse")
    # each key names what changes the KV, so blended KV is filed apart per strategy and parameter
    keys = {Deviation().key(), Deviation(1.0).key(), ChunkStarts().key(), ChunkStarts(4).key(), QuestionAttention().key()}
    assert len(keys) == 5
