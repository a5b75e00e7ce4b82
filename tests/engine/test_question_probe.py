"""A³'s question probe reads only KV that is there: the prefix hit, the reused chunks and the question's own
keys. The gaps between reused chunks are computed later by the blended pass; until then their slots hold
whatever their blocks held before, which must not take attention mass from the chunks."""
from __future__ import annotations

import random

import torch

from reuse_server.engine.blender import QuestionProbe
from reuse_server.kv.pool import KVPool

BS, HEADS, DIM = 4, 1, 8


def probe_mass(gap_keys: torch.Tensor, seed: int) -> torch.Tensor:
    """Positions 0-3 reused, 4-5 a gap not computed yet (its slots hold gap_keys), 6-7 the question."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(num_layers=2, num_blocks=3, block_size=BS, num_kv_heads=HEADS, head_dim=DIM)
    table = torch.tensor([1, 2])
    reused = torch.randn(4, HEADS, DIM, generator=gen)
    pool.write(0, torch.arange(BS, BS + 4), reused, reused)
    pool.write(0, torch.tensor([2 * BS, 2 * BS + 1]), gap_keys, gap_keys)
    q = torch.randn(2, HEADS, DIM, generator=gen)
    k = torch.randn(2, HEADS, DIM, generator=gen)
    mass = torch.zeros(8)
    ready = torch.tensor([0, 1, 2, 3, 6, 7])
    probe = QuestionProbe(pool, table, 8, ready, 2, DIM ** -0.5, 2, mass)
    assert probe.rows(0, q, k, k, None) is None  # layer 0 is not the last: every row goes on
    return mass


def test_the_probe_attends_only_over_kv_that_is_there():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    garbage = probe_mass(torch.full((2, HEADS, DIM), 50.0), seed)
    clean = probe_mass(torch.zeros(2, HEADS, DIM), seed)
    assert torch.equal(garbage, clean)
    assert garbage[4:6].eq(0).all()
    # each of the 2 question tokens spreads one unit of attention over the positions it sees
    assert torch.isclose(garbage.sum(), torch.tensor(2.0))
