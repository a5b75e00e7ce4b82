"""KV events in vLLM's wire format (its `KVEventsConfig`): which blocks this server holds and where, for a
router that sends each prompt to the replica already holding most of it (vllm-router `kv_aware`, Dynamo's KV
router, llm-d's precise prefix scorer).

The events are the radix cache's own (radix.events: a full block stored in the tree, or evicted from it) and
the tiers' (a block copied out to host RAM, written to disk or Redis, or pushed out of host RAM), each with the
`medium` it now lives in: device, host, disk or redis (GPU, CPU, DISK, REDIS on the wire: MEDIA). Only exact prompt KV is announced: blended KV and chunk
index entries (their own namespaces, at positions a prompt's prefix never has) would only mislead a router.

Wire format, as vllm-router 0.1.17 and Dynamo 1.6.1 both read it (../shared/REFERENCES.md):
- a ZMQ PUB socket (XPUB here, so we can count subscribers) sending multipart
  `[topic, sequence number (8 bytes big-endian), msgpack([timestamp, [event, ...], data_parallel_rank])]`;
- each event a msgpack map tagged by `"type"`: `BlockStored` (block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name), `BlockRemoved` (block_hashes, medium). One `BlockStored` per
  unbroken chain (block i's parent is block i-1), as vLLM sends them. `AllBlocksCleared` is never needed: a
  cache reset evicts, so each block's removal is sent, and a restarted server numbers its batches from 0 again,
  which routers take for a new run;
- block hashes are 63-bit unsigned integers (the first 8 bytes of our chained hash, shifted so that no reader
  takes them for a negative int64); the parent of a prompt's first block is nil. Routers hash the token ids
  themselves (sha256 per block in vllm-router, xxh3-64 in Dynamo), so they must be told our block size; our
  hashes only link a block to its parent and name it in a removal.
- a replay ROUTER socket (vLLM's protocol): a client sends the first sequence number it lacks (8 bytes
  big-endian, after an empty delimiter frame) and gets `[b"", seq, payload]` for every buffered batch from
  there, then `[b"", -1 (8 bytes, signed), b""]`.

Publishing never holds up the engine: the cache's thread only appends the records to a bounded queue (a full
queue drops the batch and counts it); one thread of our own encodes, sends and answers replays. A subscriber
that is slow or gone costs a message dropped at the socket's high-water mark, nothing more."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

import msgpack
import numpy as np
import zmq

from blend.chunk_index import ChunkIndex
from reuse_server.kv.block_manager import APPROXIMATE

log = logging.getLogger(__name__)

# Where a block lives, as the events spell it: vLLM's own names where it has them (GPU for the engine's pool,
# whatever its device; CPU for host RAM, which Dynamo counts as host-pinned), so both routers know the tier.
MEDIA = {"device": "GPU", "host": "CPU", "disk": "DISK", "redis": "REDIS"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_CHUNK_TAGS = (ChunkIndex.chunk_namespace(alone=True), ChunkIndex.chunk_namespace(alone=False))
_POLL_SECONDS = 0.05


def wire_hash(block_hash: bytes) -> int:
    """Our chained block hash as the 63-bit integer the events carry."""
    return int.from_bytes(block_hash[:8], "big") >> 1


def announced(namespace: bytes) -> bool:
    """Whether blocks of this namespace are exact prompt KV (what a router can match a prompt against)."""
    return APPROXIMATE not in namespace and not namespace.startswith(_CHUNK_TAGS)


class KVEvents:
    """The publisher. `stored`/`removed` make it a radix cache listener (medium device); the tiers call
    `tier_stored`/`tier_removed`. `root` (set once the cache exists: its hasher's `root`) tells a prompt's first
    block, whose parent goes out as nil."""

    def __init__(self, endpoint: str, block_size: int, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 10_000,
                 data_parallel_rank: int = 0):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.block_size = block_size
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.root: Callable[[bytes], bytes] | None = None
        self.published = 0  # batches sent (the next sequence number)
        self.dropped = 0  # batches the engine could not queue (the queue was full)
        self.subscribers = 0  # live subscriptions to our topic, from the XPUB socket's messages
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._roots: dict[bytes, bytes] = {}
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every subscribe and unsubscribe, not only the first
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot publish KV events on {endpoint} / {replay_endpoint}: {exc}") from exc
        # Nothing is sent before the first block: a subscriber's first batch is then sequence number 0, as from
        # vLLM (Dynamo's listener takes a first batch numbered higher for a gap). A router that knew an earlier
        # run of this server sees the numbers start again and forgets what it knew.
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the engine's side: queue only -----------------------------------------------------------
    def stored(self, records) -> None:
        self._put(("stored", "device", records))

    def removed(self, records) -> None:
        self._put(("removed", "device", records))

    def tier_stored(self, medium: str, entries) -> None:
        self._put(("stored", medium, entries))

    def tier_removed(self, medium: str, entries) -> None:
        self._put(("removed", medium, entries))

    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV event queue full: events dropped; routers will see a stale view of this server")

    def describe(self) -> dict:
        """What /server_info says about the events."""
        return dict(endpoint=self.endpoint, replay_endpoint=self.replay_endpoint, topic=self.topic,
                    block_size=self.block_size, format="vllm", hash="63-bit prefix of the chained block hash",
                    media=MEDIA, published=self.published, dropped=self.dropped,
                    subscribers=self.subscribers)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout` seconds), then close the sockets."""
        self._running = False
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # ---- the publisher's thread ---------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            items = self._drain()
            if items:
                try:
                    self._send(items)
                except Exception:  # a bug here must cost events, never the thread
                    log.exception("KV events: a batch could not be sent")
            elif not self._running:
                break
            for sock, _ in poller.poll(0 if items else _POLL_SECONDS * 1000):
                if sock is self._pub:
                    self._subscription()
                else:
                    self._serve_replay()

    def _drain(self) -> list:
        items = []
        try:
            while len(items) < 1024:
                items.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return items

    def _send(self, items: list) -> None:
        events = []
        for kind, medium, records in items:
            records = [r for r in records if r.hash and announced(r.namespace)]
            if not records:
                continue
            medium = MEDIA[medium]
            if kind == "stored":
                events.extend(self._stored_events(records, medium))
            else:
                events.append({"type": "BlockRemoved", "block_hashes": [wire_hash(r.hash) for r in records],
                               "medium": medium})
        if not events:
            return
        seq = self.published
        payload = msgpack.packb([time.time(), events, self.data_parallel_rank], use_bin_type=True)
        try:
            self._pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:  # nobody can take it now; the replay buffer still has it
            pass
        self._buffer.append((seq, payload))
        self.published = seq + 1

    def _stored_events(self, records: list, medium: str) -> list[dict]:
        """One BlockStored per unbroken chain of records."""
        chains: list[list] = []
        for r in records:
            if chains and r.parent_hash == chains[-1][-1].hash:
                chains[-1].append(r)
            else:
                chains.append([r])
        events = []
        for chain in chains:
            first = chain[0]
            parent = None if first.parent_hash == self._root(first.namespace) else wire_hash(first.parent_hash)
            tokens = np.frombuffer(b"".join(r.tokens for r in chain), dtype="<i4").tolist()
            events.append({"type": "BlockStored", "block_hashes": [wire_hash(r.hash) for r in chain],
                           "parent_block_hash": parent, "token_ids": tokens, "block_size": self.block_size,
                           "lora_id": None, "medium": medium, "lora_name": None})
        return events

    def _root(self, namespace: bytes) -> bytes | None:
        if self.root is None:
            return None
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self.root(namespace)
        return root

    def _subscription(self) -> None:
        msg = self._pub.recv()
        if msg[:1] == b"\x01":
            self.subscribers += 1
        elif msg[:1] == b"\x00":
            self.subscribers = max(0, self.subscribers - 1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) < 2 or len(frames[-1]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])
