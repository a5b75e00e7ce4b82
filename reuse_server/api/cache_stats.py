"""GET /v1/cache/stats: what the KV cache holds, measured: the device pool's blocks and the tokens actually
in them (a block is allocated whole; the empty slots of partly filled last blocks are waste), cached vs in
use, each tier below the pool, and the prompt-cache pins (cache_control breakpoints): blocks and tokens pinned,
per tenant (its digest; "default" without API keys) with its pins' soonest and latest expiry in seconds and
those given way before their time (a tenant key sees only its own tenant's: cache_viewer.py), and how the pool
and host tier were sized at start (`sizing`: the figures read and the rule applied, kv/sizing.py), and what
blending reused, filed and its fidelity check rejected (`blend`)."""
from __future__ import annotations

import json
import math

from reuse_server.api.cache_viewer import CacheViewer
from reuse_server.engine.client import EngineClient


def blend_section(snap: dict) -> dict:
    """Non-prefix reuse since the start: tokens blended and recomputed, chunks filed, and what the fidelity
    check rejected (chunks, and their tokens recomputed) under which threshold (null: the check is off)."""
    limit = snap["blend_max_deviation"]  # as calibrated, where --blend-max-deviation is auto
    return {"blended_tokens": snap["blended_tokens"], "recomputed_tokens": snap["recomputed_tokens"],
            "registered_chunks": snap["blend_registered_chunks"], "rejected_chunks": snap["blend_rejected_chunks"],
            "rejected_tokens": snap["blend_rejected_tokens"],
            "max_deviation": limit if math.isfinite(limit) else None}


def cache_stats(engine: EngineClient, viewer: CacheViewer) -> str:
    snap = engine.snapshot()
    return json.dumps({
        "object": "cache.stats",
        "model": engine.model_id,
        "device": {**snap["memory"], "evictable_blocks": snap["evictable_blocks"],
                   "in_use_blocks": snap["in_use_blocks"], "evicted_blocks": snap["evicted_blocks"]},
        "pins": viewer.pins(snap["pins"]),
        "tiers": snap["tiers"],
        "requests": {"running": snap["running"], "waiting": snap["waiting"]},
        "blend": blend_section(snap),
        "sizing": engine.sizing.as_dict(),
    })
