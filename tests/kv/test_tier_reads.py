"""The tiers' read path at the level of blocks: payloads read straight into the pool blocks the caller took
(disk files with readv, Redis values off the socket, into KVPool.read_targets), or into a reused buffer whose
rows the pool imports in runs, each checked as it is read. Each test reads real files or a real redis-server
and compares the pool's bytes with what was written."""
from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from redis_server import redis_server
from reuse_server.kv.pool import KVPool
from reuse_server.kv.tiers.blob import BlobContext, BlockEntry, check, encode
from reuse_server.kv.tiers import disk as disk_module
from reuse_server.kv.tiers.disk import DiskTier
from reuse_server.kv.tiers.host import HostTier
from reuse_server.kv.tiers.manager import KVTiers, Wanted
from reuse_server.kv.tiers import resp
from reuse_server.kv.tiers.reads import ReadBuffer
from reuse_server.kv.tiers.remote import MGET_BATCH, MGET_WHOLE, RedisTier

N = MGET_WHOLE + MGET_BATCH + 5  # a read in more MGETs than are sent ahead


def setup(n: int = N, dtype=torch.float32):
    pool = KVPool(2, 2 * n + 3, 4, 2, 8, dtype)
    torch.manual_seed(0)
    pool.write(0, torch.arange(pool.num_slots), torch.randn(pool.num_slots, 2, 8), torch.randn(pool.num_slots, 2, 8))
    pool.write(1, torch.arange(pool.num_slots), torch.randn(pool.num_slots, 2, 8), torch.randn(pool.num_slots, 2, 8))
    ctx = BlobContext("ab" * 16, 4, "xxh3_128", pool.layout.describe(), pool.layout.nbytes)
    kv = pool.export_blocks(list(range(n)))
    hashes = [os.urandom(16) for _ in range(n)]
    entries = [BlockEntry(h, hashes[i - 1] if i else b"\0" * 16, os.urandom(16), b"ns", kv[i])
               for i, h in enumerate(hashes)]
    wanted = [Wanted(i, e.hash, e.parent_hash, e.tokens) for i, e in enumerate(entries)]
    return pool, ctx, kv, entries, wanted


def read_all(pool, tiers, wanted, contiguous=True):
    found = tiers.fetch(wanted, contiguous=contiguous)
    into = list(range(pool.num_blocks - len(found), pool.num_blocks))
    tiers.load(into, [found[i] for i in sorted(found)])
    return found, pool.export_blocks(into)


def written(make, entries):
    """A tier (make()) that wrote `entries` and closed, opened again (a restart: what it holds is read back)."""
    tier = make()
    tier.put(entries)
    assert tier.close(30)
    return make()


def flipped(path):
    """The file at path with one bit of its payload flipped (its checksum no longer matches)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    return path


def cut(path):
    """The file at path cut short."""
    path.write_bytes(path.read_bytes()[:100])
    return path


def damage_in_redis(client, remote, ctx, entries) -> None:
    """Block 3's value with a bit flipped, block MGET_BATCH + 1's cut short (in the second MGET), block 5's gone."""
    value = bytearray(encode(entries[3], ctx))
    value[-40] ^= 1
    client.set(remote.key(entries[3].hash), bytes(value))
    client.set(remote.key(entries[MGET_BATCH + 1].hash), b"short")
    client.delete(remote.key(entries[5].hash))


def read_into_pool(pool, tiers, wanted, contiguous=True):
    """fetch with `into`: wanted block i goes into pool block num_blocks - 1 - i (backwards: not one run)."""
    into = {w.index: pool.num_blocks - 1 - w.index for w in wanted}
    found = tiers.fetch(wanted, contiguous=contiguous, into=into)
    return found, {i: pool.export_blocks([into[i]])[0] for i in found}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_targets_are_the_blocks_memory_in_a_buffers_order(dtype):
    pool, _, kv, _, _ = setup(8, dtype)
    targets = pool.read_targets([12, 9, 3])
    assert len(targets) == 3 and len(targets[0]) == 2 * pool.num_layers
    for target, row in zip(targets, kv[:3]):
        offset = 0
        for piece in target:  # a read fills the pieces in order, as a file's payload lies
            piece[:] = row[offset:offset + piece.nbytes].numpy()
            offset += piece.nbytes
        assert offset == pool.layout.nbytes
    assert torch.equal(pool.export_blocks([12, 9, 3]), kv[:3])
    assert pool.read_targets([1], pool.layout_for(torch.float16)) is None  # another dtype: converted on import
    assert KVPool(2, 4, 4, 2, 8, torch.float8_e4m3fn).read_targets([1]) is None  # scales: read, then import


def test_host_ram_blocks_are_copied_into_the_blocks_given():
    pool, _, kv, entries, wanted = setup()
    host = HostTier(1 << 30)
    host.put(entries)
    found, loaded = read_into_pool(pool, KVTiers(pool, host=host), wanted)
    assert sorted(found) == list(range(N)) and all(torch.equal(loaded[i], kv[i]) for i in found)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_import_rows_takes_adjacent_and_scattered_rows_into_any_blocks(dtype):
    pool, _, kv, _, _ = setup(8, dtype)
    rows = list(kv.unbind(0))
    scattered = [rows[3], rows[1], rows[2], kv[5].clone(), rows[6], rows[7]]
    for into in ([10, 11, 12, 13, 14, 15], [15, 9, 12, 10, 16, 11]):
        pool.import_rows(into, scattered)
        assert torch.equal(pool.export_blocks(into), torch.stack(scattered))
    with pytest.raises(ValueError):
        pool.import_rows([1, 2], [rows[0][:-1], rows[1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_export_gathers_scattered_blocks_in_their_order(dtype):
    pool, _, _, _, _ = setup(8, dtype)
    ids = [5, 6, 7, 2, 0, 1, 9]
    values = pool.layout.decode(pool.export_blocks(ids))  # [n, layers, K/V, block, heads, dim]
    for layer in range(pool.num_layers):
        k, v = pool.gather_blocks(layer, torch.tensor(ids))
        assert torch.equal(values[:, layer, 0], k.float()) and torch.equal(values[:, layer, 1], v.float())
    if not pool.quantized:
        assert pool.export_blocks([]).shape == (0, pool.layout.nbytes)


def test_a_read_buffer_is_reused_only_once_the_rows_it_gave_are_gone():
    reads = ReadBuffer(8)
    first = reads.rows(4)
    for r in first:
        r.fill_(1)
    second = reads.rows(4)  # the first rows are alive: a new buffer
    for r in second:
        r.fill_(2)
    assert all(int(r.sum()) == 8 for r in first)
    pointer = second[0].data_ptr()
    del first, second, r
    assert reads.rows(3)[0].data_ptr() == pointer


def test_host_ram_blocks_go_into_the_pool_as_they_were():
    pool, _, kv, entries, wanted = setup()
    host = HostTier(1 << 30)
    host.put(entries[::-1][:10] + entries[:-10])  # rows of two batches, partly in reverse order
    found, loaded = read_all(pool, KVTiers(pool, host=host), wanted)
    assert len(found) == N and torch.equal(loaded, kv)


def test_disk_reads_every_block_back_and_a_damaged_file_is_a_miss(tmp_path):
    pool, ctx, kv, entries, wanted = setup()
    disk = written(lambda: DiskTier(tmp_path, 1 << 30, ctx), entries)
    found, loaded = read_all(pool, KVTiers(pool, disk=disk), wanted)
    assert len(found) == N and torch.equal(loaded, kv)
    bad, short = flipped(disk._path(entries[7].hash)), cut(disk._path(entries[9].hash))
    found, _ = read_all(pool, KVTiers(pool, disk=disk), wanted, contiguous=False)
    assert sorted(found) == [i for i in range(N) if i not in (7, 9)]
    assert all(torch.equal(found[i].entry.kv, kv[i]) for i in found)
    assert disk.stats.corrupt == 2 and not bad.exists() and not short.exists()


def test_disk_reads_straight_into_the_pools_blocks_and_a_damaged_file_is_a_miss(tmp_path):
    pool, ctx, kv, entries, wanted = setup()
    disk = written(lambda: DiskTier(tmp_path, 1 << 30, ctx), entries)
    tiers = KVTiers(pool, disk=disk)
    found, loaded = read_into_pool(pool, tiers, wanted)
    assert sorted(found) == list(range(N)) and all(torch.equal(loaded[i], kv[i]) for i in found)
    assert all(f.entry.kv is None for f in found.values())  # in the pool, not in a buffer
    assert disk._reads._buffer is None  # no read buffer was ever made: no fresh memory, no copy
    bad, short = flipped(disk._path(entries[7].hash)), cut(disk._path(entries[9].hash))
    pool._data.zero_()
    found, loaded = read_into_pool(pool, tiers, wanted, contiguous=False)
    assert sorted(found) == [i for i in range(N) if i not in (7, 9)]
    assert all(torch.equal(loaded[i], kv[i]) for i in found)
    assert disk.stats.corrupt == 2 and not bad.exists() and not short.exists()
    found, _ = read_into_pool(pool, tiers, wanted)  # a chain stops at its first miss
    assert sorted(found) == list(range(7))


def test_a_disk_read_opens_files_ahead_and_leaves_none_open(tmp_path, monkeypatch):
    """Files are opened (and their reads asked for) a few ahead of the one read: every block still comes back,
    a file gone since the index listed it and a damaged one are misses, and no file stays open after."""
    monkeypatch.setattr(disk_module, "READ_AHEAD", 4)
    pool, ctx, kv, entries, wanted = setup()
    disk = written(lambda: DiskTier(tmp_path, 1 << 30, ctx), entries)
    disk._path(entries[5].hash).unlink()
    flipped(disk._path(entries[20].hash))
    open_before = sorted(os.listdir("/proc/self/fd"))
    found, loaded = read_into_pool(pool, KVTiers(pool, disk=disk), wanted, contiguous=False)
    assert sorted(os.listdir("/proc/self/fd")) == open_before
    assert sorted(found) == [i for i in range(N) if i not in (5, 20)]
    assert all(torch.equal(loaded[i], kv[i]) for i in found)
    assert disk.stats.errors == 1 and disk.stats.corrupt == 1


def test_redis_reads_straight_into_the_pools_blocks_and_a_damaged_value_is_a_miss_deleted():
    pool, ctx, kv, entries, wanted = setup()
    with redis_server() as server:
        remote = written(lambda: RedisTier(server.url, ctx, timeout=2), entries)
        tiers = KVTiers(pool, remote=remote)
        found, loaded = read_into_pool(pool, tiers, wanted)
        assert sorted(found) == list(range(N)) and all(torch.equal(loaded[i], kv[i]) for i in found)
        assert all(f.entry.kv is None for f in found.values()) and remote._reads._buffer is None
        client = server.client()
        damage_in_redis(client, remote, ctx, entries)
        pool._data.zero_()
        found, loaded = read_into_pool(pool, tiers, wanted, contiguous=False)
        assert sorted(found) == [i for i in range(N) if i not in (3, 5, MGET_BATCH + 1)]
        assert all(torch.equal(loaded[i], kv[i]) for i in found)
        assert remote.stats.corrupt == 2 and client.exists(remote.key(entries[3].hash)) == 0
        assert tiers.held(wanted, contiguous=True).blocks == wanted[:3]  # what Redis holds: EXISTS
        assert [w.index for w in tiers.held(wanted, contiguous=False).blocks] == [
            i for i in range(N) if i not in (3, 5, MGET_BATCH + 1)]


def test_redis_reads_every_block_back_and_a_damaged_value_is_a_miss_deleted():
    pool, ctx, kv, entries, wanted = setup()
    with redis_server() as server:
        remote = written(lambda: RedisTier(server.url, ctx, timeout=2), entries)
        found, loaded = read_all(pool, KVTiers(pool, remote=remote), wanted)
        assert len(found) == N and torch.equal(loaded, kv)
        client = server.client()
        damage_in_redis(client, remote, ctx, entries)
        remote = RedisTier(server.url, ctx, timeout=2)
        found, _ = read_all(pool, KVTiers(pool, remote=remote), wanted, contiguous=False)
        assert sorted(found) == [i for i in range(N) if i not in (3, 5, MGET_BATCH + 1)]
        assert all(torch.equal(found[i].entry.kv, kv[i]) for i in found)
        assert remote.stats.corrupt == 2 and remote.stats.errors == 0
        assert client.exists(remote.key(entries[3].hash), remote.key(entries[MGET_BATCH + 1].hash)) == 0
        found, _ = read_all(pool, KVTiers(pool, remote=remote), wanted)  # a chain stops at its first miss
        assert sorted(found) == [0, 1, 2]
        assert client.ping()  # the connection read raw is left at a reply's end: the client goes on
        assert remote.client.get(remote.key(entries[0].hash)) == encode(entries[0], ctx)


@pytest.mark.parametrize("reader", ["scatter", "buffered"])
def test_both_socket_readers_place_an_mget_reply_where_it_goes(reader):
    """The scatter reader (plain sockets) and the buffered one (TLS) on the same reply bytes, sent in pieces
    that end anywhere: two values into pool blocks, a missing key, a value too short to be a block."""
    pool, ctx, kv, entries, _ = setup(4)
    blobs = [encode(e, ctx) for e in entries[:2]]
    reply = b"*4\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(b), b) for b in blobs) + b"$-1\r\n$5\r\nshort\r\n"
    ours, theirs = socket.socketpair()

    def send() -> None:
        for i in range(0, len(reply), 997):
            theirs.sendall(reply[i:i + 997])

    sender = threading.Thread(target=send)
    sender.start()
    with (resp._ScatterReader(ours) if reader == "scatter" else
          resp._BufferedReader(ours.makefile("rb", buffering=resp.READ_CHUNK))) as r:
        assert resp._header(r, b"*") == 4
        targets = pool.read_targets([5, 6, 7, 8])
        got = {}
        for i in range(4):
            resp._value(r, targets[i], ctx, i, lambda i, head, checksum: got.update({i: (head, checksum)}))
    sender.join()
    ours.close()
    theirs.close()
    assert torch.equal(pool.export_blocks([5, 6]), kv[:2])
    for i in range(2):
        entry = check(got[i][0], targets[i], got[i][1], ctx, entries[i].hash)
        assert entry.kv is None and entry.tokens == entries[i].tokens
    assert got[2] == (None, None) and got[3][1] is None
