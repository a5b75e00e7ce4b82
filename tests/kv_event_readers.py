"""Test helper: read our KV events the way the routers read them, with a real ZMQ subscriber (pyzmq + msgpack).

What each router requires (../shared/REFERENCES.md, vllm-router's src/kv_index/wire.rs and subscriber.rs):
- vllm-router 0.1.17: the batch is a positional array `[ts, events, rank?]`; every event a map tagged by
  `"type"` (a tag-first array is rejected); hashes bytes or unsigned ints; it hashes each block's token ids
  itself (sha256 of the u32-LE ids, no chaining) and links blocks by the worker's hashes (parent nil: a root).
- Dynamo 1.6.1: the same fields; it hashes each block with xxh3-64, seed 1337, over the u32-LE ids.
So a reader here refuses anything either would refuse, and keeps per medium the blocks a worker holds as
the router would: by the router's own block hash, in chains from a root."""
from __future__ import annotations

import hashlib
import struct
import time

import msgpack
import xxhash
import zmq

STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name"}


def vllm_router_hash(tokens: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()


def dynamo_hash(tokens: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=1337)


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """A batch as both routers decode it; AssertionError where either would reject it."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) in (2, 3), "a batch is the array [ts, events, rank]"
    ts, events = batch[0], batch[1]
    assert isinstance(ts, float) and isinstance(events, list)
    for event in events:
        assert isinstance(event, dict), "KV event must be a tagged map"
        assert all(isinstance(k, str) for k in event), "KV event keys must be strings"
        kind = event["type"]
        assert kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        if kind == "AllBlocksCleared":
            continue
        hashes = event["block_hashes"]
        assert hashes and all(isinstance(h, int) and 0 <= h < 2**63 for h in hashes)
        if kind == "BlockStored":
            assert STORED_FIELDS <= set(event)
            parent = event["parent_block_hash"]
            assert parent is None or (isinstance(parent, int) and 0 <= parent < 2**63)
            assert len(event["token_ids"]) == len(hashes) * event["block_size"]
    return ts, events, batch[2] if len(batch) > 2 else None


class RouterView:
    """What a router knows of one worker, per medium: its blocks, named by the router's own hashes."""

    def __init__(self, block_size: int, local_hash=vllm_router_hash):
        self.block_size = block_size
        self.local_hash = local_hash
        self.blocks: dict[str, dict[int, tuple[object, int | None]]] = {}  # medium -> worker hash -> (local, parent)
        self.batches: list[tuple[int, bytes]] = []
        self.events: list[dict] = []

    def apply(self, seq: int, payload: bytes) -> None:
        assert not self.batches or seq == self.batches[-1][0] + 1, "sequence numbers run without a gap"
        self.batches.append((seq, payload))
        _, events, _ = decode_batch(payload)
        for event in events:
            self.events.append(event)
            if event["type"] == "AllBlocksCleared":
                self.blocks.clear()
                continue
            held = self.blocks.setdefault(event["medium"], {})
            if event["type"] == "BlockRemoved":
                for h in event["block_hashes"]:
                    held.pop(h, None)
                continue
            assert event["block_size"] == self.block_size
            parent = event["parent_block_hash"]
            tokens = event["token_ids"]
            for i, h in enumerate(event["block_hashes"]):
                block = tokens[i * self.block_size:(i + 1) * self.block_size]
                held[h] = (self.local_hash(block), parent)
                parent = h

    def cached_blocks(self, tokens: list[int], medium: str = "GPU") -> int:
        """How many leading full blocks of `tokens` the router would find on this worker in `medium`: an
        unbroken chain from a root whose local hashes are the prompt's."""
        held = self.blocks.get(medium, {})
        by_parent = {(parent, local): h for h, (local, parent) in held.items()}
        parent, n = None, 0
        for i in range(len(tokens) // self.block_size):
            h = by_parent.get((parent, self.local_hash(tokens[i * self.block_size:(i + 1) * self.block_size])))
            if h is None:
                break
            parent, n = h, n + 1
        return n


def subscribe(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def read(sub: zmq.Socket, view: RouterView, done, timeout: float = 60.0) -> None:
    """Apply batches from `sub` to `view` until `done()` (a safety deadline, not a measure)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the events did not come"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            view.apply(int.from_bytes(seq, "big"), payload)


def replay(endpoint: str, start: int, timeout: float = 30.0) -> list[tuple[int, bytes]]:
    """Ask a replay endpoint for the batches from `start` on, as vLLM's clients do (a DEALER: an empty delimiter,
    then the 8-byte big-endian start; batches come back as [b"", seq, payload] until seq -1)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(int(timeout * 1000)), "the replay did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return got
            got.append((seq, payload))
    finally:
        dealer.close()
