"""What each tier counts (in blocks, bytes and seconds), read by /metrics and GET /v1/cache/stats."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TierStats:
    queries: int = 0  # blocks looked up
    hits: int = 0  # blocks found, verified and loaded
    declined: int = 0  # blocks found but left: recomputing them was measured to be cheaper
    read_bytes: int = 0
    read_seconds: float = 0.0
    written: int = 0  # blocks stored
    written_bytes: int = 0
    write_seconds: float = 0.0
    dropped_writes: int = 0  # blocks not stored: the write queue was full or the tier unavailable
    corrupt: int = 0  # blocks found damaged or foreign: deleted, never served
    errors: int = 0  # failed operations (I/O errors, a store that did not answer)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
