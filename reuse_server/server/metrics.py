"""Prometheus metrics: engine counters and pool gauges read from `engine.snapshot()` at scrape time,
plus latency histograms and a finished-request counter that the engine feeds as requests progress."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                   60.0, 120.0)

# snapshot key -> (counter name without _total, help)
COUNTERS = {
    "prefix_query_tokens": ("kvreuse_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_hit_tokens": ("kvreuse_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "blended_tokens": ("kvreuse_blended_tokens", "Prompt tokens reused from non-prefix chunks (blending)."),
    "recomputed_tokens": ("kvreuse_recomputed_tokens", "Reused prompt tokens recomputed by blending selection."),
    "blend_rejected_chunks": ("kvreuse_blend_rejected_chunks", "Reused chunks the blending fidelity check "
                              "rejected (their KV deviated past --blend-max-deviation) and recomputed whole."),
    "blend_rejected_tokens": ("kvreuse_blend_rejected_tokens", "Reused prompt tokens recomputed because the "
                              "fidelity check rejected their chunk (also counted in kvreuse_recomputed_tokens)."),
    "prompt_tokens": ("kvreuse_prompt_tokens", "Prompt tokens of admitted requests."),
    "generation_tokens": ("kvreuse_generation_tokens", "Tokens generated."),
    "evicted_blocks": ("kvreuse_evicted_blocks", "KV blocks evicted from the cache."),
    "preemptions": ("kvreuse_preemptions", "Running sequences preempted for lack of KV blocks."),
}


class _SnapshotCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        snap = self.engine.snapshot()
        for key, (name, doc) in COUNTERS.items():
            if key in snap:
                yield CounterMetricFamily(name, doc, value=snap[key])
        pins = snap.get("pins")
        pinned = pins["pinned_blocks"] if pins is not None else 0
        # in_use is what running requests hold; blocks kept only by prompt-cache pins (cache_control
        # breakpoints) are a state of their own, so the four states add up to the pool
        blocks = GaugeMetricFamily("kvreuse_kv_blocks", "KV cache blocks by state (free, evictable, pinned by "
                                   "cache_control breakpoints, in use by requests).", labels=["state"])
        for state, value in (("free", snap["free_blocks"]), ("evictable", snap["evictable_blocks"]),
                             ("pinned", pinned), ("in_use", snap["in_use_blocks"] - pinned)):
            blocks.add_metric([state], value)
        yield blocks
        yield GaugeMetricFamily("kvreuse_kv_blocks_total", "KV cache blocks in the pool.", value=snap["total_blocks"])
        if pins is not None:
            yield CounterMetricFamily("kvreuse_kv_pins_given_way", "Prompt-cache pins released before their time "
                                      "(a tenant past --max-pinned-share, a pool that could admit no one).",
                                      value=pins["given_way"])
        yield GaugeMetricFamily("kvreuse_requests_running", "Requests being decoded or prefilled.",
                                value=snap["running"])
        yield GaugeMetricFamily("kvreuse_requests_waiting", "Requests queued for admission.", value=snap["waiting"])
        memory = snap.get("memory")
        if memory:
            yield GaugeMetricFamily("kvreuse_kv_pool_bytes", "Bytes of the device KV pool.", value=memory["pool_bytes"])
            held = GaugeMetricFamily("kvreuse_kv_tokens", "Tokens whose KV the pool holds, by holder.",
                                     labels=["holder"])
            held.add_metric(["cached"], memory["cached_tokens"])
            held.add_metric(["sequences"], memory["sequence_tokens"])
            yield held
            yield GaugeMetricFamily("kvreuse_kv_empty_slots", "Allocated KV slots holding no token (partly filled "
                                    "last blocks, blocks taken for a chunk not yet computed).", value=memory["empty_slots"])
        yield from _tier_metrics(snap.get("tiers") or {})


# tier stats key -> (metric name without _total, help)
TIER_COUNTERS = {
    "queries": ("kvreuse_tier_queries", "Blocks looked up in a tier below the device pool."),
    "hits": ("kvreuse_tier_hits", "Blocks found in a tier and loaded into the device pool."),
    "declined": ("kvreuse_tier_declined", "Blocks found in a tier but recomputed: measured cheaper than fetching."),
    "read_bytes": ("kvreuse_tier_read_bytes", "Bytes read from a tier."),
    "read_seconds": ("kvreuse_tier_read_seconds", "Seconds spent reading from a tier."),
    "written": ("kvreuse_tier_written_blocks", "Blocks stored in a tier."),
    "written_bytes": ("kvreuse_tier_written_bytes", "Bytes written to a tier."),
    "write_seconds": ("kvreuse_tier_write_seconds", "Seconds spent writing to a tier."),
    "dropped_writes": ("kvreuse_tier_dropped_writes", "Blocks not stored: write queue full or tier unavailable."),
    "corrupt": ("kvreuse_tier_corrupt_blocks", "Blocks found damaged, foreign or holding other tokens: deleted."),
    "errors": ("kvreuse_tier_errors", "Failed tier operations (I/O errors, Redis not answering)."),
}


def _tier_metrics(tiers: dict):
    if not tiers:
        return
    for key, (name, doc) in TIER_COUNTERS.items():
        family = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, stats in tiers.items():
            family.add_metric([tier], stats[key])
        yield family
    for key, name, doc in (("blocks", "kvreuse_tier_blocks", "Blocks held by a tier."),
                           ("bytes", "kvreuse_tier_bytes", "Bytes held by a tier (local tiers)."),
                           ("write_queue_bytes", "kvreuse_tier_write_queue_bytes", "Bytes waiting to be written.")):
        family = GaugeMetricFamily(name, doc, labels=["tier"])
        for tier, stats in tiers.items():
            if stats.get(key) is not None:
                family.add_metric([tier], stats[key])
        yield family


class ServerMetrics:
    def __init__(self, engine, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(_SnapshotCollector(engine))
        self.ttft = Histogram("kvreuse_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvreuse_e2e_request_latency_seconds", "Time from arrival to the request's end.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("kvreuse_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=self.registry)

    # Called from the engine thread; prometheus-client metrics are thread-safe.
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_request(self, seconds: float, finish_reason: str | None) -> None:
        self.e2e.observe(seconds)
        self.requests.labels(finish_reason=finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def wire_metrics(engine) -> ServerMetrics:
    """The metrics of a server around `engine` (an LLMEngine or AsyncEngine), which reports TTFT and request
    ends to them as they happen; GET /metrics renders them (api.app.create_app)."""
    metrics = ServerMetrics(engine)
    engine.metrics = metrics
    return metrics
