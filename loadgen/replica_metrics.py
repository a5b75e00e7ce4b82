"""Per-replica figures when the load goes through a gateway (`run --replica-metrics URL ...`): each replica's
/metrics is read before and after a phase, and the deltas give, per replica, the requests it served, its
prefix hit rate, its mean TTFT (the server's own histogram: arrival to first token) and the blocks it loaded
from Redis; and how evenly the gateway spread the work."""
from __future__ import annotations

import asyncio
import statistics

import httpx

from loadgen.metrics_scrape import counter_deltas, scrape

REPLICA_COUNTERS = {
    "requests": "kvreuse_requests_total",
    "prompt_tokens": "kvreuse_prompt_tokens_total",
    "prefix_cache_queries": "kvreuse_prefix_cache_queries_total",
    "prefix_cache_hits": "kvreuse_prefix_cache_hits_total",
    "ttft_sum_s": "kvreuse_time_to_first_token_seconds_sum",
    "ttft_count": "kvreuse_time_to_first_token_seconds_count",
    "redis_hit_blocks": ("kvreuse_tier_hits_total", {"tier": "redis"}),
    "redis_query_blocks": ("kvreuse_tier_queries_total", {"tier": "redis"}),
}


async def scrape_replicas(client: httpx.AsyncClient, urls: list[str]) -> list[dict[str, float] | None]:
    """Each replica's counters; one that has no sample yet (a labelled counter before its first request, a
    tier the replica does not have) counts 0. None for a replica whose /metrics could not be read."""
    scraped = await asyncio.gather(*(scrape(client, url, counters=REPLICA_COUNTERS) for url in urls))
    return [None if s is None else {key: s.get(key, 0.0) for key in REPLICA_COUNTERS} for s in scraped]


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den else None


def replica_entry(url: str, delta: dict[str, float | None]) -> dict:
    return {
        "url": url,
        "requests": delta["requests"],
        "prompt_tokens": delta["prompt_tokens"],
        "prefix_hit_rate": _ratio(delta["prefix_cache_hits"], delta["prefix_cache_queries"]),
        "ttft_mean_ms": None if _ratio(delta["ttft_sum_s"], delta["ttft_count"]) is None
        else 1000 * delta["ttft_sum_s"] / delta["ttft_count"],
        "redis_hit_blocks": delta["redis_hit_blocks"],
        "redis_query_blocks": delta["redis_query_blocks"],
    }


def spread(entries: list[dict]) -> dict:
    """How evenly the work went: requests per replica, the busiest replica's share, the coefficient of
    variation of requests (0: perfectly even), and the range of hit rates and mean TTFTs."""
    requests = [e["requests"] for e in entries]
    if not entries or any(r is None for r in requests):
        return {"requests": None, "max_request_share": None, "requests_cv": None,
                "prefix_hit_rate_range": None, "ttft_mean_ms_range": None}
    total = sum(requests)
    mean = total / len(requests)

    def value_range(key):
        values = [e[key] for e in entries if e[key] is not None]
        return [min(values), max(values)] if values else None

    return {
        "requests": requests,
        "max_request_share": max(requests) / total if total else None,
        "requests_cv": statistics.pstdev(requests) / mean if mean else None,
        "prefix_hit_rate_range": value_range("prefix_hit_rate"),
        "ttft_mean_ms_range": value_range("ttft_mean_ms"),
    }


def replica_report(urls: list[str], before: list, after: list) -> dict:
    entries = [replica_entry(url, counter_deltas(b, a, REPLICA_COUNTERS)) for url, b, a in zip(urls, before, after)]
    return {"per_replica": entries, "spread": spread(entries)}
