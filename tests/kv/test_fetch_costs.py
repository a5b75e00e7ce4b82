"""The fetch-or-recompute decision (kv/tiers/costs.py): measured rates decide, a declined tier is measured
again now and then, and `always` reads whatever the rates say."""
from reuse_server.kv.tiers.costs import REMEASURE_EVERY, FetchCosts


def slow_tier(always: bool = False) -> FetchCosts:
    costs = FetchCosts(block_size=16, always=always)
    costs.observe_prefill(tokens=1000, seconds=0.1)  # 1.6 ms to recompute a block
    costs.observe_read("redis", blocks=1, seconds=0.05)  # 50 ms to read one
    return costs


def test_unmeasured_tiers_are_tried_and_a_cheaper_read_wins():
    costs = FetchCosts(block_size=16)
    assert costs.worth_fetching("host")  # nothing measured yet: reading is how it gets measured
    costs.observe_prefill(tokens=1000, seconds=1.0)
    costs.observe_read("host", blocks=10, seconds=0.001)
    assert all(costs.worth_fetching("host") for _ in range(3 * REMEASURE_EVERY))


def test_a_declined_tier_is_read_again_once_every_so_many_declines():
    costs = slow_tier()
    decisions = [costs.worth_fetching("redis") for _ in range(3 * REMEASURE_EVERY)]
    assert decisions.count(True) == 3
    assert [i for i, d in enumerate(decisions) if d] == [REMEASURE_EVERY - 1, 2 * REMEASURE_EVERY - 1,
                                                         3 * REMEASURE_EVERY - 1]
    # the new read was fast: the tier is used again from then on
    costs.observe_read("redis", blocks=100, seconds=0.0001)
    for _ in range(20):
        costs.observe_read("redis", blocks=100, seconds=0.0001)
    assert all(costs.worth_fetching("redis") for _ in range(REMEASURE_EVERY))


def test_always_reads_whatever_the_rates_say():
    costs = slow_tier(always=True)
    assert all(costs.worth_fetching("redis") for _ in range(3 * REMEASURE_EVERY))
