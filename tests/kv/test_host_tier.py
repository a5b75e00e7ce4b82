"""The host RAM tier counts the memory it really keeps alive: its entries are rows of the batch buffers the
pool exports, and a row keeps its whole batch alive."""
from __future__ import annotations

import gc
import random
import weakref
from pathlib import Path

import torch

from reuse_server.kv.tiers import BlobContext, DiskTier, HostTier, RedisTier
from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.tier import Tier

ROW = 1024  # bytes of one block's KV
SEED = 20261201


def batch(first: int, rows: int) -> tuple[list[BlockEntry], torch.Tensor]:
    """Entries that are rows of one buffer, as one export gives them (KVTiers._copy_out)."""
    data = torch.arange(rows * ROW, dtype=torch.int32).to(torch.uint8).view(rows, ROW) + first
    return [BlockEntry(bytes([first + i]) * 16, b"\x00" * 16, b"", b"", data[i]) for i in range(rows)], data


def held(tier: HostTier) -> dict[bytes, BlockEntry]:
    """The tier's entries, read without touching its LRU order (a get would move them)."""
    with tier._lock:
        return dict(tier._entries)


def held_bytes(tier: HostTier) -> int:
    """What the entries the tier holds keep alive: each distinct buffer once, whole."""
    storages = {}
    for entry in held(tier).values():
        storage = entry.kv.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def assert_holds(tier: HostTier, expected: dict) -> None:
    got = held(tier)
    assert set(got) == set(expected)
    for h, entry in got.items():
        assert torch.equal(entry.payload(), expected[h])


def test_evicting_rows_of_a_batch_out_of_order_counts_what_is_held_and_frees_the_batch():
    rng = random.Random(SEED)
    print("seed", SEED)
    tier = HostTier(capacity_bytes=100 * ROW)
    entries, data = batch(0, 8)
    alive = weakref.ref(data)
    expected = {e.hash: e.kv.clone() for e in entries}
    del data
    tier.put(entries)
    del entries
    assert tier.used_bytes == 8 * ROW == held_bytes(tier)
    order = list(expected)
    rng.shuffle(order)
    for i, h in enumerate(order):
        tier.discard(h)
        left = order[i + 1:]
        assert tier.num_blocks == len(left)
        assert tier.used_bytes == held_bytes(tier), (i, left)
        # the tier never keeps more alive than twice what its rows need
        assert tier.used_bytes <= 2 * ROW * len(left)
        assert_holds(tier, {h2: expected[h2] for h2 in left})  # the rows copied out kept their bytes
    gc.collect()
    assert alive() is None  # the batch's memory went once its rows were gone or copied out
    assert tier.used_bytes == 0


def test_the_byte_limit_holds_for_the_memory_kept_alive_when_hits_keep_rows_of_old_batches():
    rng = random.Random(SEED + 1)
    print("seed", SEED + 1)
    tier = HostTier(capacity_bytes=24 * ROW)
    put = {}
    for b in range(10):
        entries, _ = batch(16 * b, 8)
        tier.put(entries)
        put.update({e.hash: e.kv.clone() for e in entries})
        del entries
        # hits on a few random rows move them to the recent end, away from the rest of their batch
        tier.get(rng.sample(sorted(held(tier)), 3))
        kept = [h for h in put if tier.contains(h)]
        assert tier.used_bytes == held_bytes(tier) <= tier.capacity_bytes
        assert tier.used_bytes <= 2 * ROW * tier.num_blocks  # a batch is let go once half of it is not rows held
        if b >= 3:  # past the limit: eviction frees what it must and at most one batch more
            assert tier.used_bytes > tier.capacity_bytes - 8 * ROW
        assert_holds(tier, {h: put[h] for h in kept})


def test_a_batch_larger_than_the_tier_is_kept_row_by_row():
    tier = HostTier(capacity_bytes=4 * ROW)
    entries, _ = batch(0, 8)
    tier.put(entries)
    kept = [e.hash for e in entries if tier.contains(e.hash)]
    assert len(kept) == 4 and tier.used_bytes == 4 * ROW == held_bytes(tier)


def test_every_tier_has_the_tier_protocol(tmp_path: Path):
    ctx = BlobContext(fingerprint="ab" * 16, block_size=4, hash_algo="xxh3_128", layout={}, kv_bytes=ROW)
    disk = DiskTier(tmp_path, 10 * ROW, ctx)
    try:
        for tier in (HostTier(ROW), disk):
            assert isinstance(tier, Tier)
            assert tier.num_blocks == 0 and tier.used_bytes == 0 and tier.write_queue_bytes == 0
    finally:
        disk.close(1.0)
    remote = RedisTier("redis://127.0.0.1:9", ctx)  # nothing is asked of it here: no server needed
    try:
        assert isinstance(remote, Tier) and remote.num_blocks is None and remote.write_queue_bytes == 0
    finally:
        remote.close(1.0)


def test_touched_blocks_are_evicted_last():
    """Write-through holds blocks from when they were computed; a block the pool evicts later is touched then
    (host RAM is now its only copy), so older untouched blocks go first."""
    tier = HostTier(capacity_bytes=4 * ROW)
    entries = [batch(i, 1)[0][0] for i in range(4)]  # one buffer each: each counts alone
    tier.put(entries)
    tier.touch([entries[0].hash, b"never held" * 2])
    tier.put([batch(10, 1)[0][0]])
    assert set(held(tier)) == {entries[0].hash, entries[2].hash, entries[3].hash, bytes([10]) * 16}
