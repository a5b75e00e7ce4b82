"""bench_blend's rows read TTFT per case: on a shared machine the load moves between cases, and only the ratio
of a case's full prefill to its blended run (measured back to back) cancels it."""
from argparse import Namespace

from benchmarks.bench_blend import summarize

SETTINGS = Namespace(check_layers="1", gradual_factors="1", score="kv", key_shift=True,
                     precompute_after_template=True, fill="traffic", prefix_cache=True, model=None, glued=True,
                     chunk_tokens=64)
CONFIGS = [("full", False, None, False, None), ("ratio=0.15", True, 0.15, True, None)]


def result(ttft: list[float], load: list[tuple[float, float]]) -> dict:
    n = len(ttft)
    return dict(correct=n, kl=[0.0] * n, agree=[True] * n, ttft=ttft, blended=60 * n, recomputed=10 * n,
                prefix=5 * n, prompt=100 * n, load=load)


def test_per_case_speedup_cancels_load_that_changes_between_cases():
    # three cases; load rose tenfold at the second: each blended run is 4x faster than its own full prefill
    full = [1.0, 10.0, 12.0]
    blended = [0.25, 2.5, 3.0]
    load = [(1.0, 2.0), (9.0, 11.0), (12.0, 10.5)]
    rows = summarize({"full": result(full, load), "ratio=0.15": result(blended, load)}, CONFIGS, 3, SETTINGS)
    row = rows[1]
    assert row["ttft_speedup_case_median"] == 4.0
    assert row["ttft_speedup_case_quartiles"] == [4.0, 4.0, 4.0]
    assert row["ttft_speedup"] == 4.0  # here the medians agree too; the next test is where they part
    assert row["loadavg"] == dict(start=1.0, end=10.5, min=1.0, max=12.0)


def test_ratio_of_medians_and_per_case_median_part_when_load_shifts_the_medians():
    full = [1.0, 1.0, 20.0, 20.0, 20.0]  # load came after the second case for full prefill's runs ...
    blended = [0.5, 0.5, 0.5, 10.0, 10.0]  # ... and one case later for the blended runs
    load = [(1.0, 1.0)] * 5
    row = summarize({"full": result(full, load), "ratio=0.15": result(blended, load)}, CONFIGS, 5, SETTINGS)[1]
    assert row["ttft_speedup"] == 40.0  # 20 / 0.5: the medians fell on different sides of the load change
    assert row["ttft_speedup_case_median"] == 2.0  # per case: 2, 2, 40, 2, 2
