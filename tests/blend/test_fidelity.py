"""blend/fidelity.py: the per-chunk relative deviation the fidelity check compares with its threshold."""
from __future__ import annotations

import math
import random

import pytest
import torch

from blend.fidelity import ChunkDeviation, FidelityCheck


def test_each_chunks_deviation_is_its_relative_l2_summed_over_slices():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    n, heads, dim = 30, 2, 8
    new_k, new_v = torch.randn(n, heads, dim, generator=gen), torch.randn(n, heads, dim, generator=gen)
    old_k = new_k + 0.1 * torch.randn(n, heads, dim, generator=gen)
    old_v = new_v + 0.5 * torch.randn(n, heads, dim, generator=gen)
    chunk = torch.tensor([0] * 12 + [1] * 18)
    dev = ChunkDeviation(3)  # chunk 2 is never seen
    for lo, hi in ((0, 7), (7, 20), (20, 30)):  # three slices, the first chunk cut by a boundary
        dev.add(chunk[lo:hi], old_k[lo:hi], new_k[lo:hi], old_v[lo:hi], new_v[lo:hi])
    rel = dev.relative()
    for c, rows in ((0, slice(0, 12)), (1, slice(12, 30))):
        want_k = torch.linalg.norm(new_k[rows] - old_k[rows]) / torch.linalg.norm(new_k[rows])
        want_v = torch.linalg.norm(new_v[rows] - old_v[rows]) / torch.linalg.norm(new_v[rows])
        assert rel[c].tolist() == pytest.approx([float(want_k), float(want_v)], rel=1e-5)
        assert float(dev.deviation()[c]) == pytest.approx(max(float(want_k), float(want_v)), rel=1e-5)
    assert rel[2].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("bad", [-0.1, math.nan])
def test_a_threshold_must_be_a_number_at_least_zero(bad):
    with pytest.raises(ValueError):
        FidelityCheck(bad)
    assert not FidelityCheck(math.inf).active and FidelityCheck(0.0).active
