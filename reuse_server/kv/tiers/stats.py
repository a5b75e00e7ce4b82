"""What each tier counts (in blocks, bytes and seconds), read by /metrics and GET /v1/cache/stats.

Two writers, two records: a tier writes its `TierStats` (what it read, wrote, dropped and found damaged);
KVTiers writes a `Lookups` per tier (what it asked the tier for and what it did with the answers: declined
as dearer than recomputing, verified and loaded, found holding other tokens). `figures` joins them into the
one dict per tier that the service shows."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TierStats:
    read_bytes: int = 0
    written: int = 0  # blocks stored
    written_bytes: int = 0
    write_seconds: float = 0.0
    dropped_writes: int = 0  # blocks not stored: the write queue was full or the tier unavailable
    corrupt: int = 0  # blobs found damaged or foreign: deleted, never served
    errors: int = 0  # failed operations (I/O errors, a store that did not answer)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Lookups:
    queries: int = 0  # blocks looked up
    hits: int = 0  # blocks found, verified and loaded
    declined: int = 0  # blocks found but left: recomputing them was measured to be cheaper
    mismatched: int = 0  # blocks found holding other tokens than asked for: dropped, never served
    read_seconds: float = 0.0  # the tier's reads and the copies of what they gave into the pool


def figures(stats: TierStats, lookups: Lookups) -> dict:
    """One tier's figures as the service shows them (a block dropped for holding other tokens counts as
    corrupt, like a damaged blob)."""
    own = stats.as_dict()
    out = {"queries": lookups.queries, "hits": lookups.hits, "declined": lookups.declined,
           "read_bytes": own.pop("read_bytes"), "read_seconds": lookups.read_seconds, **own}
    out["corrupt"] += lookups.mismatched
    return out
