"""The server's Prometheus `/metrics`, read before and after each phase so the report can show
what the server itself counted over the same window."""
from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

# report key -> sample name in the text format, or (name, labels the sample must carry)
COUNTERS = {
    "prompt_tokens": "kvreuse_prompt_tokens_total",
    "generation_tokens": "kvreuse_generation_tokens_total",
    "prefix_cache_queries": "kvreuse_prefix_cache_queries_total",
    "prefix_cache_hits": "kvreuse_prefix_cache_hits_total",
    "blended_tokens": "kvreuse_blended_tokens_total",
    "recomputed_tokens": "kvreuse_recomputed_tokens_total",
    "evicted_blocks": "kvreuse_evicted_blocks_total",
    # the server's own time to first token (arrival to the first sampled token), as a sum and a count
    "ttft_seconds_sum": "kvreuse_time_to_first_token_seconds_sum",
    "first_tokens": "kvreuse_time_to_first_token_seconds_count",
}
RUNNING = "kvreuse_requests_running"


def parse_counters(text: str, counters: dict = COUNTERS) -> dict[str, float]:
    """Values by report key, summed over the label sets that match; absent samples are left out."""
    wanted: dict[str, list[tuple[str, dict]]] = {}
    for key, spec in counters.items():
        name, labels = (spec, {}) if isinstance(spec, str) else spec
        wanted.setdefault(name, []).append((key, labels))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, labels in wanted.get(sample.name, ()):
                if all(sample.labels.get(k) == v for k, v in labels.items()):
                    out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def requests_running(text: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RUNNING:
                return float(sample.value)
    return None


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None,
                   counters: dict = COUNTERS) -> dict[str, float | None]:
    """after - before per counter; None where either side did not have it (or a scrape failed)."""
    return {key: (after[key] - before[key]) if before and after and key in before and key in after else None
            for key in counters}


async def scrape(client: httpx.AsyncClient, server: str, settle_s: float = 2.0,
                 counters: dict = COUNTERS) -> dict[str, float] | None:
    """Counters once the server has no request running (waits up to `settle_s`, since the last
    response can reach us a moment before the server has finished its bookkeeping).
    None when /metrics cannot be read: the run goes on, the report just lacks the server's view."""
    deadline = asyncio.get_running_loop().time() + settle_s
    try:
        while True:
            resp = await client.get(f"{server}/metrics")
            resp.raise_for_status()
            running = requests_running(resp.text)
            if not running or asyncio.get_running_loop().time() >= deadline:
                return parse_counters(resp.text, counters)
            await asyncio.sleep(0.05)
    except (httpx.HTTPError, ValueError):
        return None
