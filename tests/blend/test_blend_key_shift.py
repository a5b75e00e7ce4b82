"""blend/key_shift.py: estimating the mean pre-RoPE key difference and adding it, rotated, to paged keys."""
from __future__ import annotations

import pytest
import torch

from blend.key_shift import KeyShift, KeyShiftEstimate, unrope
from blend.rope import apply_rope, default_inv_freq

LAYERS, HEADS, HD = 3, 2, 8


def test_unrope_undoes_rope():
    g = torch.Generator().manual_seed(0)
    inv_freq = default_inv_freq(HD)
    x = torch.randn(20, HEADS, HD, generator=g)
    pos = torch.randint(0, 5000, (20,), generator=g)
    assert torch.allclose(unrope(apply_rope(x, pos, inv_freq), pos, inv_freq), x, atol=1e-5)


def test_estimate_recovers_a_planted_shift_whatever_the_positions():
    g = torch.Generator().manual_seed(1)
    inv_freq = default_inv_freq(HD)
    planted = torch.randn(LAYERS, HEADS, HD, generator=g)
    est = KeyShiftEstimate(LAYERS, HEADS, HD, inv_freq)
    for chunk in range(6):
        n = 10 + chunk
        alone_pos = torch.arange(3, 3 + n)
        ctx_pos = torch.arange(100 * chunk + 40, 100 * chunk + 40 + n)
        raw = [torch.randn(n, HEADS, HD, generator=g) for _ in range(LAYERS)]
        noise = [0.01 * torch.randn(n, HEADS, HD, generator=g) for _ in range(LAYERS)]
        alone = [apply_rope(r, alone_pos, inv_freq) for r in raw]
        in_ctx = [apply_rope(r + planted[i] + noise[i], ctx_pos, inv_freq) for i, r in enumerate(raw)]
        est.add(in_ctx, ctx_pos, alone, alone_pos)
    assert torch.allclose(est.result().k, planted, atol=0.01)


def test_apply_adds_the_rotated_shift_to_the_given_slots_of_every_layer():
    g = torch.Generator().manual_seed(2)
    inv_freq = default_inv_freq(HD)
    shift = KeyShift(torch.randn(LAYERS, HEADS, HD, generator=g))
    pools = [torch.randn(6, 4, HEADS, HD, generator=g) for _ in range(LAYERS)]
    before = [p.clone() for p in pools]
    slots = torch.tensor([21, 2, 9, 10])  # scattered over blocks, out of order
    positions = torch.tensor([700, 55, 56, 1234])
    shift.apply_(pools, slots, positions, inv_freq)
    for layer in range(LAYERS):
        flat, old = pools[layer].view(-1, HEADS, HD), before[layer].view(-1, HEADS, HD)
        # pre-RoPE, the keys moved by exactly the shift
        moved = unrope(flat[slots], positions, inv_freq) - unrope(old[slots], positions, inv_freq)
        assert torch.allclose(moved, shift.k[layer].expand_as(moved), atol=1e-5)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(flat[untouched], old[untouched])


def test_a_per_layer_table_unrotates_and_rotates_each_layer_with_its_own_base():
    """Gemma 3: the estimate un-rotates, and apply_ rotates, each layer with its own RoPE base."""
    g = torch.Generator().manual_seed(3)
    table = torch.stack([default_inv_freq(HD, 10000.0), default_inv_freq(HD, 1000000.0), default_inv_freq(HD, 10000.0)])
    planted = torch.randn(LAYERS, HEADS, HD, generator=g)
    est = KeyShiftEstimate(LAYERS, HEADS, HD, table)
    n = 12
    alone_pos, ctx_pos = torch.arange(3, 3 + n), torch.arange(900, 900 + n)
    raw = [torch.randn(n, HEADS, HD, generator=g) for _ in range(LAYERS)]
    est.add([apply_rope(r + planted[i], ctx_pos, table[i]) for i, r in enumerate(raw)], ctx_pos,
            [apply_rope(r, alone_pos, table[i]) for i, r in enumerate(raw)], alone_pos)
    shift = est.result()
    assert torch.allclose(shift.k, planted, atol=1e-4)
    pools = [torch.zeros(6, 4, HEADS, HD) for _ in range(LAYERS)]
    slots, positions = torch.tensor([21, 2, 9]), torch.tensor([700, 55, 30000])
    shift.apply_(pools, slots, positions, table)
    for layer in range(LAYERS):
        added = unrope(pools[layer].view(-1, HEADS, HD)[slots], positions, table[layer])
        assert torch.allclose(added, shift.k[layer].expand_as(added), atol=1e-4), layer


def test_apply_keeps_the_pool_dtype():
    inv_freq = default_inv_freq(HD)
    shift = KeyShift(torch.ones(1, HEADS, HD))
    pool = torch.zeros(2, 4, HEADS, HD, dtype=torch.bfloat16)
    shift.apply_([pool], torch.tensor([0]), torch.tensor([0]), inv_freq)
    assert pool.dtype == torch.bfloat16 and torch.equal(pool.view(-1, HEADS, HD)[0], torch.ones(HEADS, HD, dtype=torch.bfloat16))


def test_layer_count_mismatch_and_empty_estimate_are_errors():
    inv_freq = default_inv_freq(HD)
    with pytest.raises(ValueError, match="layers"):
        KeyShift(torch.zeros(2, HEADS, HD)).apply_([torch.zeros(1, 4, HEADS, HD)], torch.tensor([0]),
                                                    torch.tensor([0]), inv_freq)
    with pytest.raises(ValueError, match="no tokens"):
        KeyShiftEstimate(LAYERS, HEADS, HD, inv_freq).result()


def test_round_trips_through_a_dict():
    shift = KeyShift(torch.randn(LAYERS, HEADS, HD))
    assert torch.equal(KeyShift.from_dict(shift.to_dict()).k, shift.k)
