"""L3: blocks in Redis (or Valkey), shared by every server on the same model: what one computed, the others
reuse. One key per block, `kvreuse:<fingerprint prefix>[-<tier dtype>]:<block hash>`, its value a self-describing blob
(tiers/blob.py), so a value from another model or a damaged one is never served.

Writes are batched into pipelines by a background writer; reads of a prompt's blocks are MGETs pipelined,
their values read off the socket straight into the pool blocks taken for them (or a reused buffer,
tiers/resp.py). The client has short timeouts: if Redis is down or slow, requests go on without it (misses,
counted), the outage is logged once, and calls are retried after a growing pause until it answers again. Run
Redis without persistence and with an LRU memory bound: `--save '' --appendonly no --maxmemory 4gb
--maxmemory-policy allkeys-lru`.

Redis may lose any block at any time (restarted empty, FLUSHALL, a key evicted at maxmemory): a lost block is
a miss that costs a recompute. A block this server wrote or read is remembered as stored (so that it is not
written again); a read or EXISTS that finds it gone forgets it, so the next time it is computed it is written
again and the hit rate recovers. A write Redis refuses (out of memory under `noeviction`) drops that block
only; it is not an outage. Where only an unbroken run of blocks is any use (the chain continuing what the
device holds), the read stops at the first missing block (EXISTS before MGET), so blocks whose parents were
evicted are not transferred for nothing (but for a block Redis evicts while a read longer than MGET_WHOLE is
under way)."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from reuse_server.kv.tiers.blob import BadBlob, BlobContext, BlockEntry, check, encode
from reuse_server.kv.tiers.reads import ReadBuffer
from reuse_server.kv.tiers.resp import mget_into
from reuse_server.kv.tiers.stats import TierStats
from reuse_server.kv.tiers.writer import BackgroundWriter

log = logging.getLogger(__name__)

KNOWN_LIMIT = 200_000  # hashes remembered as stored, so that blocks read from Redis are not written back
MAX_PAUSE = 30.0
# Keys per MGET. A read of up to MGET_WHOLE keys is one MGET: one reply, with no command of ours in between at
# which Redis could evict a block the read still wants (it evicts before it runs a command, and the replies'
# buffers count toward maxmemory). A longer read goes in MGETs of MGET_BATCH keys: Redis builds each reply whole
# before it sends any of it, and builds the next one (sent ahead) instead of sending, so smaller replies keep it
# sending more of the time (a 4,096-token prompt of the bundled model, 256 blocks of 737 KB, on loopback: 8 keys
# 196 ms, 16 keys 229 ms, 32 keys 248 ms, medians of 8 reads).
MGET_WHOLE = 32
MGET_BATCH = 8


class RedisTier:
    name = "redis"

    def __init__(self, url: str, ctx: BlobContext, timeout: float = 0.25, max_queue_bytes: int = 256 << 20,
                 reads: ReadBuffer | None = None):
        self.ctx = ctx
        self.url = url
        self.stats = TierStats()
        self.prefix = f"kvreuse:{ctx.name}:".encode()
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=30,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1))
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._refusing_writes = False  # Redis answers but refuses SETs (logged once until one succeeds)
        self._reads = reads or ReadBuffer(ctx.kv_bytes)  # a CUDA pool's is pinned (reads.read_buffer)
        self._lock = threading.Lock()  # outage state and `_known` are shared by the engine thread and the writer
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._pause = 0.5
        self.writer = BackgroundWriter("redis", self._write_batch, self.stats, max_queue_bytes)

    def key(self, block_hash: bytes) -> bytes:
        return self.prefix + block_hash.hex().encode()

    @property
    def available(self) -> bool:
        return self._down_since is None or time.monotonic() >= self._retry_at

    def _failed(self, exc: Exception) -> None:
        self.stats.errors += 1
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                log.warning("Redis at %s unavailable (%s): going on without it", self.url, exc)
            else:
                self._pause = min(MAX_PAUSE, self._pause * 2)
            self._retry_at = now + self._pause

    def _answered(self) -> None:
        if self._down_since is not None:
            with self._lock:
                if self._down_since is not None:
                    log.warning("Redis at %s is back after %.1f s", self.url, time.monotonic() - self._down_since)
                    self._down_since, self._pause = None, 0.5

    def _remember(self, hashes) -> None:
        with self._lock:
            for h in hashes:
                self._known[h] = None
                self._known.move_to_end(h)
            while len(self._known) > KNOWN_LIMIT:
                self._known.popitem(last=False)

    @property
    def num_blocks(self) -> None:
        return None  # Redis is shared and evicts on its own: what it holds is not known here

    @property
    def used_bytes(self) -> None:
        return None

    def _forget(self, hashes) -> None:
        with self._lock:
            for h in hashes:
                self._known.pop(h, None)

    def contains(self, block_hash: bytes) -> bool | None:
        """None: unknown without asking Redis (get asks)."""
        return True if block_hash in self._known else None

    def get(self, hashes: list[bytes], contiguous: bool = False,
            into: dict[bytes, list] | None = None) -> dict[bytes, BlockEntry]:
        """The blocks Redis holds among `hashes`: MGETs (one, or of MGET_BATCH keys), pipelined, their values'
        payloads read straight where they go and checked as each arrives (tiers/resp.py): into
        the buffers `into` gives by hash (KVPool.read_targets: a pool block's memory; the entry's kv is then
        None), else into the tier's read buffer. contiguous: only the unbroken run from the first hash, read
        up to the first missing block."""
        if not self.available or not hashes:
            return {}
        try:
            asked = self._held_run(hashes) if contiguous else hashes
            values = self._read(asked, into) if asked else []
        except redis.RedisError as exc:
            self._failed(exc)
            return {}
        self._answered()
        if contiguous:  # a block evicted meanwhile breaks the run: nothing after it is any use
            gone = next((i for i, v in enumerate(values) if v is None), len(values))
            values = values[:gone]
        # Lost from Redis (restart, flush, eviction): forgotten, so they are written again once computed.
        # After a break in a contiguous read nothing is known of the rest: forgotten too (a write again of a
        # block Redis still holds only replaces it).
        self._forget([h for h, v in zip(asked, values) if v is None] + (hashes[len(values):] if contiguous else []))
        found, bad = {}, []
        for h, value in zip(asked, values):
            if value is None:
                continue
            entry, exc = value
            if exc is not None:
                log.warning("Redis: deleting %s: %s", self.key(h).decode(), exc)
                self.stats.corrupt += 1
                bad.append(self.key(h))
            else:
                found[h] = entry
        if bad:
            try:
                self.client.delete(*bad)
            except redis.RedisError as exc:
                self._failed(exc)
        self._remember(found)
        return found

    def holds(self, hashes: list[bytes]) -> list[bool]:
        """Whether Redis holds each block now (EXISTS in one pipeline); none while it is down. Those it has
        lost are forgotten as stored (written again once computed), as a read that misses them forgets them."""
        if not self.available or not hashes:
            return [False] * len(hashes)
        try:
            held = self._exists(hashes)
        except redis.RedisError as exc:
            self._failed(exc)
            return [False] * len(hashes)
        self._answered()
        self._forget([h for h, yes in zip(hashes, held) if not yes])
        return held

    def _exists(self, hashes: list[bytes]) -> list[bool]:
        with self.client.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.exists(self.key(h))
            return [bool(n) for n in pipe.execute()]

    def _held_run(self, hashes: list[bytes]) -> list[bytes]:
        """The unbroken run of `hashes` from the first that Redis holds: EXISTS in one pipeline (tiny replies),
        so that no value after a gap is transferred."""
        held = self._exists(hashes)
        return hashes[:next((i for i, h in enumerate(held) if not h), len(hashes))]

    def _read(self, hashes: list[bytes], into: dict[bytes, list] | None = None) -> list:
        """Per hash: None (not in Redis) or (entry, None) or (None, BadBlob)."""
        payloads, targets = self._reads.destinations(hashes, into)
        values: list = [None] * len(hashes)

        def arrived(i: int, head: bytearray | None, checksum: bytearray | None) -> None:
            if head is None:
                return
            self.stats.read_bytes += len(head) + self.ctx.kv_bytes + (len(checksum) if checksum is not None else 0)
            if checksum is None:
                values[i] = (None, BadBlob("truncated"))
                return
            try:
                values[i] = (check(head, payloads[i], checksum, self.ctx, hashes[i]), None)
            except BadBlob as exc:
                values[i] = (None, exc)

        keys = [self.key(h) for h in hashes]
        size = len(keys) if len(keys) <= MGET_WHOLE else MGET_BATCH
        mget_into(self.client, [keys[i:i + size] for i in range(0, len(keys), size)], targets, self.ctx, arrived)
        return values

    def discard(self, block_hash: bytes) -> None:
        try:
            self.client.delete(self.key(block_hash))
        except redis.RedisError as exc:
            self._failed(exc)

    def put(self, entries: list[BlockEntry]) -> None:
        self.writer.put([e for e in entries if e.hash not in self._known])

    def _write_batch(self, entries: list[BlockEntry]) -> None:
        if not self.available:
            self.stats.dropped_writes += len(entries)
            return
        start = time.perf_counter()
        blobs = [encode(e, self.ctx) for e in entries]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for entry, blob in zip(entries, blobs):
                    pipe.set(self.key(entry.hash), blob)
                results = pipe.execute(raise_on_error=False)  # a refused SET is that block's, not an outage
        except redis.RedisError as exc:
            self._failed(exc)
            self.stats.dropped_writes += len(entries)
            return
        self._answered()
        self.stats.write_seconds += time.perf_counter() - start
        refused = [r for r in results if isinstance(r, Exception)]
        stored = [(e, b) for e, b, r in zip(entries, blobs, results) if not isinstance(r, Exception)]
        if refused:
            self.stats.errors += 1
            self.stats.dropped_writes += len(refused)
            if not self._refusing_writes:
                log.warning("Redis at %s refuses writes (%s): those blocks are not shared", self.url, refused[0])
                self._refusing_writes = True
        elif self._refusing_writes:
            log.warning("Redis at %s takes writes again", self.url)
            self._refusing_writes = False
        self.stats.written += len(stored)
        self.stats.written_bytes += sum(len(b) for _, b in stored)
        self._remember(e.hash for e, _ in stored)

    @property
    def write_queue_bytes(self) -> int:
        return self.writer.queued_bytes

    def close(self, timeout: float = 10.0) -> bool:
        done = self.writer.close(timeout)
        self.client.close()
        return done
