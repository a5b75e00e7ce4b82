"""L1: blocks evicted from the device pool, kept in host RAM under their block hash, least recently used
out first. On a CUDA server the copies go device -> pinned host memory without the engine waiting for them
(KVPool.export_blocks_async); on a CPU-only server the device pool and this tier are the same RAM, so it is
a larger extension of the pool that costs a copy to get back into it (a memcpy per block, against
recomputing it)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.stats import TierStats


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, on_evict: Callable[[list[BlockEntry]], None] | None = None):
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict  # write-back: where entries pushed out of RAM go next
        self.stats = TierStats()
        self._entries: OrderedDict[bytes, BlockEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # /metrics reads sizes from another thread

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def get(self, hashes: list[bytes], contiguous: bool = False) -> dict[bytes, BlockEntry]:
        """contiguous: stop at the first block not held (only an unbroken run is any use)."""
        found = {}
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is None and contiguous:
                    break
                if entry is not None:
                    self._entries.move_to_end(h)
                    found[h] = entry
                    self.stats.read_bytes += entry.nbytes
        return found

    def put(self, entries: list[BlockEntry]) -> None:
        evicted = []
        with self._lock:
            for entry in entries:
                if entry.nbytes > self.capacity_bytes:
                    continue
                old = self._entries.pop(entry.hash, None)
                if old is not None:
                    self._bytes -= old.nbytes
                self._entries[entry.hash] = entry
                self._bytes += entry.nbytes
                self.stats.written += 1
                self.stats.written_bytes += entry.nbytes
            while self._bytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                evicted.append(old)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    def discard(self, block_hash: bytes) -> None:
        with self._lock:
            old = self._entries.pop(block_hash, None)
            if old is not None:
                self._bytes -= old.nbytes

    def close(self, timeout: float = 0.0) -> None:
        pass
