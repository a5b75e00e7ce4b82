"""L1: blocks computed in (write-through) or evicted from (write-back) the device pool, kept in host RAM under their block hash, least recently used
out first. On a CUDA server the copies go device -> host without the engine waiting for them
(KVPool.export_blocks_async); on a CPU-only server the device pool and this tier are the same RAM, so it is
a larger extension of the pool that costs a copy to get back into it (a memcpy per block, against
recomputing it).

What the byte limit counts is the memory really held. The blocks of one export arrive as rows of one batch
buffer, and a row keeps its whole batch alive: the batch's memory goes only when its last row does. So a
batch counts in full while any of its rows is held, and once its rows held fall to half of it or fewer, those
rows are copied out into buffers of their own and the batch is let go. Counting rows instead would let a few
hot rows (a hit moves a row to the recent end, away from its batch) keep many times the limit alive; copying
every row out on arrival would cost a memcpy per block on every demotion (and, on CUDA, a wait for the copy
the engine did not wait for). Copying at half costs each block at most one copy, and the tier then never
holds more than twice the bytes its rows need, all of it counted."""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Callable

from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.host_memory import PageableMemory
from reuse_server.kv.tiers.stats import TierStats


@dataclasses.dataclass
class _Batch:
    nbytes: int  # the whole buffer's bytes
    rows: set[bytes]  # hashes of the entries held that are rows of it
    row_bytes: int = 0  # bytes of those rows


def _buffer_of(entry: BlockEntry) -> tuple[int, int]:
    """(identity, bytes) of the memory an entry's KV keeps alive."""
    storage = entry.kv.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, on_evict: Callable[[list[BlockEntry]], None] | None = None,
                 memory: PageableMemory | None = None):
        """memory: what entries are kept in (host_memory_for the pool's device; plain memory if None): exports
        for this tier are made in it (KVTiers), and a row copied out of its batch goes into it too."""
        self.capacity_bytes = capacity_bytes
        self.memory = memory or PageableMemory()
        self.on_evict = on_evict  # write-back: where entries pushed out of RAM go next
        self.stats = TierStats()
        self._entries: OrderedDict[bytes, BlockEntry] = OrderedDict()
        self._batches: dict[int, _Batch] = {}  # buffer identity -> its rows held
        self._children: dict[bytes, set[bytes]] = {}  # parent hash -> hashes held continuing it
        self._bytes = 0  # sum of the held batches' whole sizes
        self._lock = threading.Lock()  # /metrics reads sizes from another thread

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        """Bytes of the buffers the tier keeps alive (not only its rows')."""
        return self._bytes

    @property
    def write_queue_bytes(self) -> int:
        return 0

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def holds(self, hashes: list[bytes]) -> list[bool]:
        return [h in self._entries for h in hashes]

    def children(self, parent_hash: bytes) -> list[BlockEntry]:
        """The held blocks whose parent is `parent_hash` (a prompt's possible next blocks), without counting a
        read or moving them in the LRU order."""
        with self._lock:
            return [self._entries[h] for h in self._children.get(parent_hash, ())]

    def get(self, hashes: list[bytes], contiguous: bool = False, into=None) -> dict[bytes, BlockEntry]:
        """contiguous: stop at the first block not held (only an unbroken run is any use). into is not used:
        the entries are in RAM already (KVTiers.fetch copies them into the pool)."""
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

    def peek(self, hashes: list[bytes]) -> dict[bytes, BlockEntry]:
        """The held entries among `hashes`, without counting a read or moving them in the LRU order."""
        with self._lock:
            return {h: self._entries[h] for h in hashes if h in self._entries}

    def touch(self, hashes: list[bytes]) -> None:
        """The blocks held among `hashes` become the most recently used, in that order."""
        with self._lock:
            for h in hashes:
                if h in self._entries:
                    self._entries.move_to_end(h)

    def put(self, entries: list[BlockEntry]) -> None:
        evicted = []
        with self._lock:
            for entry in entries:
                if entry.nbytes > self.capacity_bytes:
                    continue
                if _buffer_of(entry)[1] > self.capacity_bytes:  # its batch alone would not fit: keep the row alone
                    entry = dataclasses.replace(entry, kv=self.memory.copy(entry.payload()), copied=None)
                self._drop(entry.hash)
                self._entries[entry.hash] = entry
                self._children.setdefault(entry.parent_hash, set()).add(entry.hash)
                self._hold(entry)
                self.stats.written += 1
                self.stats.written_bytes += entry.nbytes
            while self._bytes > self.capacity_bytes and self._entries:
                _, old = self._entries.popitem(last=False)
                self._let_go(old)
                evicted.append(old)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    def discard(self, block_hash: bytes) -> None:
        with self._lock:
            self._drop(block_hash)

    def close(self, timeout: float = 0.0) -> bool:
        return True

    # ---- what is held (under the lock) --------------------------------------------------------
    def _hold(self, entry: BlockEntry) -> None:
        key, nbytes = _buffer_of(entry)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(nbytes, set())
            self._bytes += nbytes
        batch.rows.add(entry.hash)
        batch.row_bytes += entry.nbytes

    def _drop(self, block_hash: bytes) -> None:
        old = self._entries.pop(block_hash, None)
        if old is not None:
            self._let_go(old)

    def _let_go(self, entry: BlockEntry) -> None:
        """entry is no longer held: its batch goes with its last row, or its few remaining rows move out."""
        siblings = self._children[entry.parent_hash]
        siblings.discard(entry.hash)
        if not siblings:
            del self._children[entry.parent_hash]
        key, _ = _buffer_of(entry)
        batch = self._batches[key]
        batch.rows.discard(entry.hash)
        batch.row_bytes -= entry.nbytes
        if batch.rows and 2 * batch.row_bytes > batch.nbytes:
            return
        del self._batches[key]
        self._bytes -= batch.nbytes
        for h in batch.rows:  # replacing a key keeps its place in the LRU order
            row = self._entries[h]
            self._entries[h] = dataclasses.replace(row, kv=self.memory.copy(row.payload()), copied=None)
            self._hold(self._entries[h])
