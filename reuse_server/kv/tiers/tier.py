"""What a tier is, to the rest of the server: one Protocol that host RAM (host.py), disk (disk.py) and Redis
(remote.py) each implement, so KVTiers (manager.py) treats every level alike and a new store plugs in by
writing these methods."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.stats import TierStats


@runtime_checkable
class Tier(Protocol):
    name: str  # "host", "disk", "redis": the key of its figures and of Found.tier
    stats: TierStats  # what the tier did; written by the tier alone (its own threads included)

    def contains(self, block_hash: bytes) -> bool | None:
        """Whether the tier holds the block; None: unknown without asking the store (get asks)."""

    def holds(self, hashes: list[bytes]) -> list[bool]:
        """Whether the tier holds each block now (asking the store if it must: what to take pool blocks for
        before reading)."""

    def get(self, hashes: list[bytes], contiguous: bool = False,
            into: dict[bytes, list] | None = None) -> dict[bytes, BlockEntry]:
        """The blocks the tier holds among `hashes` (blocking the caller); the caller verifies them. With
        `contiguous` (a chain), reading stops at the first block the tier does not hold. into: where a tier
        that reads bytes in puts each block's payload, by hash (KVPool.read_targets; the entry's kv is then
        None); without it, or for a tier whose entries are in memory already, the entries carry their kv."""

    def put(self, entries: list[BlockEntry]) -> None:
        """Keep these blocks (possibly later, on a writer thread; possibly not at all, counted)."""

    def discard(self, block_hash: bytes) -> None:
        """Drop a block the caller found bad."""

    def close(self, timeout: float = 10.0) -> bool:
        """Finish queued writes (up to `timeout` seconds) and stop; False if some were not written."""

    @property
    def num_blocks(self) -> int | None:
        """Blocks held (None: unknown, as for a store shared with other servers)."""

    @property
    def used_bytes(self) -> int | None:
        """Bytes held (None: unknown)."""

    @property
    def write_queue_bytes(self) -> int:
        """Bytes waiting to be written."""
