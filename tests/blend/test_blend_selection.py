from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blend.selection import (
    GradualSchedule,
    combine_scores,
    query_attention,
    count_for_ratio,
    first_tokens_mask,
    kv_deviation,
    select_top,
    select_top_k,
)


def test_kv_deviation_k_and_v():
    old_k, old_v = torch.randn(6, 3, 8), torch.randn(6, 3, 8)
    new_k, new_v = old_k.clone(), old_v.clone()
    new_k[2, 1, 5] += 3.0  # one element, 9.0 squared
    new_k[4] += 0.5  # 24 elements of 0.25
    new_v[0, 0, 0] -= 2.0
    dk = kv_deviation(old_k, new_k, old_v, new_v, score="k")
    dv = kv_deviation(old_k, new_k, old_v, new_v, score="v")
    assert torch.allclose(dk, torch.tensor([0, 0, 9.0, 0, 6.0, 0]), atol=1e-5)
    assert torch.allclose(dv, torch.tensor([4.0, 0, 0, 0, 0, 0]), atol=1e-5)
    assert dk.dtype == torch.float32
    # half-precision inputs are compared in fp32
    assert torch.allclose(kv_deviation(old_k.half(), new_k.half(), score="k"), dk, rtol=1e-2, atol=1e-2)


def test_kv_deviation_kv_is_scale_balanced():
    n = 50
    old_k, old_v = torch.randn(n, 2, 4), torch.randn(n, 2, 4)
    dk_true, dv_true = torch.rand(n), torch.rand(n)
    # K deviations are 1e6 times larger than V's: the raw sum would just rank by K.
    new_k = old_k.clone()
    new_k[:, 0, 0] += 1000 * dk_true.sqrt()
    new_v = old_v.clone()
    new_v[:, 0, 0] += dv_true.sqrt()
    kv = kv_deviation(old_k, new_k, old_v, new_v, score="kv")
    dk = kv_deviation(old_k, new_k, score="k")
    dv = kv_deviation(None, None, old_v, new_v, score="v")
    assert torch.allclose(kv, dk / dk.mean() + dv / dv.mean(), rtol=1e-5)
    # Each normalised term has mean 1, so the sum has mean 2; V still moves the ranking.
    assert math.isclose(kv.mean().item(), 2.0, rel_tol=1e-5)
    assert not torch.equal(kv.argsort(), dk.argsort())
    # Nothing deviates in V: the V term is zero rather than NaN.
    kv_only_k = kv_deviation(old_k, new_k, old_v, old_v.clone(), score="kv")
    assert torch.allclose(kv_only_k, dk / dk.mean(), rtol=1e-5)


def test_kv_deviation_errors():
    a = torch.randn(4, 2, 8)
    with pytest.raises(ValueError):
        kv_deviation(a, a, score="q")
    with pytest.raises(ValueError):
        kv_deviation(a, a, score="kv")  # V missing
    with pytest.raises(ValueError):
        kv_deviation(a, torch.randn(5, 2, 8))


def test_select_top_exact():
    dev = torch.tensor([0.5, 3.0, 0.1, 2.0, 9.0, 0.0, 1.0, 4.0])
    assert select_top(dev, 0.25).tolist() == [4, 7]  # ceil(0.25*8) = 2
    assert select_top(dev, 0.3).tolist() == [1, 4, 7]  # ceil(2.4) = 3, ascending
    assert select_top(dev, 0.0).tolist() == []
    assert select_top(dev, 1.0).tolist() == list(range(8))
    assert select_top(dev, 0.01).tolist() == [4]  # any positive ratio keeps at least one
    assert select_top(dev, 0.5).dtype == torch.int64


def test_select_top_ratio_rounding_and_bounds():
    # 0.1 * 30 is 3.0000000000000004 in binary floating point; it must still mean 3.
    assert count_for_ratio(0.1, 30) == 3
    assert count_for_ratio(0.15, 20) == 3
    assert count_for_ratio(0.151, 20) == 4
    assert count_for_ratio(0.5, 0) == 0
    for bad in (-0.01, 1.01, float("nan")):
        with pytest.raises(ValueError):
            select_top(torch.rand(10), bad)
    assert select_top(torch.empty(0), 0.5).tolist() == []


def test_select_top_ties_and_nan():
    dev = torch.tensor([1.0, 5.0, 5.0, 5.0, 0.0])
    assert select_top_k(dev, 2).tolist() == [1, 2]  # ties go to the lower index
    dev_nan = torch.tensor([1.0, float("nan"), 100.0, 2.0])
    assert select_top_k(dev_nan, 1).tolist() == [1]  # NaN is recomputed first
    assert select_top_k(dev_nan, 2).tolist() == [1, 2]
    assert select_top_k(dev, 100).tolist() == [0, 1, 2, 3, 4]


def test_select_top_always_on_top_of_budget():
    dev = torch.tensor([0.0, 10.0, 1.0, 8.0, 0.5, 7.0])
    always = torch.tensor([True, True, False, False, False, False])
    # Budget 2 is spent on the best non-forced tokens (3 and 5), token 1 comes anyway.
    assert select_top_k(dev, 2, always).tolist() == [0, 1, 3, 5]
    assert select_top(dev, 0.0, always).tolist() == [0, 1]
    assert select_top(dev, 1.0, always).tolist() == list(range(6))
    with pytest.raises(ValueError):
        select_top_k(dev, 1, always[:3])
    with pytest.raises(ValueError):
        select_top_k(dev, 1, always.long())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=0, max_size=40),
    st.floats(0.0, 1.0),
    st.data(),
)
def test_select_top_matches_sorting_reference(values, ratio, data):
    dev = torch.tensor(values, dtype=torch.float32)
    n = len(values)
    always_list = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    always = torch.tensor(always_list, dtype=torch.bool)
    got = select_top(dev, ratio, always).tolist()
    k = math.ceil(ratio * n - 1e-9)
    free = [i for i in range(n) if not always_list[i]]
    ranked = sorted(free, key=lambda i: (-float(dev[i]), i))
    expected = sorted(set(ranked[:k]) | {i for i in range(n) if always_list[i]})
    assert got == expected


def test_gradual_schedule_counts():
    s = GradualSchedule([1, 3, 5], [0.5, 0.25, 0.1])
    n = 40
    counts = [s.keep_count(layer, n) for layer in range(8)]
    assert counts == [40, 40, 20, 20, 10, 10, 4, 4]
    assert [s.is_check_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert s.selection_count(3, n) == 10
    with pytest.raises(ValueError):
        s.selection_count(2, n)
    s.validate_for(6)
    with pytest.raises(ValueError):
        s.validate_for(5)
    assert s.check_layers == (1, 3, 5) and s.ratios == (0.5, 0.25, 0.1)
    assert GradualSchedule([2], [0.15]).keep_count(3, 7) == 2


@pytest.mark.parametrize(
    "layers,ratios",
    [
        ([], []),
        ([1, 2], [0.5]),
        ([0, 2], [0.5, 0.2]),  # layer 0 cannot select
        ([2, 2], [0.5, 0.2]),
        ([3, 1], [0.5, 0.2]),
        ([1, 2], [0.2, 0.5]),  # ratios must not grow
        ([1], [1.5]),
        ([1], [-0.1]),
        ([1], [float("nan")]),
    ],
)
def test_gradual_schedule_validation(layers, ratios):
    with pytest.raises(ValueError):
        GradualSchedule(layers, ratios)


def test_first_tokens_mask():
    mask = first_tokens_mask([0, 5, 12], [5, 2, 4], k=3)
    expected = [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    assert mask.tolist() == [bool(x) for x in expected]
    assert first_tokens_mask([2], [3], k=1, total=8).tolist() == [False, False, True] + [False] * 5
    assert first_tokens_mask([], [], k=2).numel() == 0
    assert not first_tokens_mask([0, 4], [4, 4], k=0).any()
    with pytest.raises(ValueError):
        first_tokens_mask([0], [4], k=1, total=3)
    with pytest.raises(ValueError):
        first_tokens_mask([0, 1], [4], k=1)


def test_query_attention_is_per_head_softmax_mass_with_gqa():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 8, generator=g)  # 3 queries, 4 heads sharing 2 KV heads
    k = torch.randn(6, 2, 8, generator=g)
    q_pos, k_pos = torch.tensor([3, 4, 5]), torch.arange(6)
    mass = query_attention(q, k, q_pos, k_pos, scale=0.5)
    expected = torch.zeros(6)
    for h in range(4):
        for i, p in enumerate(q_pos.tolist()):
            scores = (k[: p + 1, h // 2] @ q[i, h]) * 0.5
            expected[: p + 1] += torch.softmax(scores, dim=0) / 4
    assert torch.allclose(mass, expected, atol=1e-6)
    assert math.isclose(float(mass.sum()), 3.0, rel_tol=1e-5)  # each query spreads one unit
    assert float(query_attention(q[:1], k, q_pos[:1], k_pos, 0.5)[4:].abs().sum()) == 0.0  # future keys


def test_combine_scores_balances_scales():
    dev = torch.tensor([100.0, 0.0, 0.0, 0.0])
    attn = torch.tensor([0.0, 0.0, 0.0, 0.01])
    assert torch.argmax(combine_scores(dev, attn, 1.0)) in (0, 3)
    assert int(torch.argmax(combine_scores(dev, attn, 2.0))) == 3  # weight favours the attended token
    with pytest.raises(ValueError):
        combine_scores(dev, attn[:3], 1.0)
