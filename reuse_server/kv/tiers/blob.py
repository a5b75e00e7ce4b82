"""One cached KV block as a self-describing blob: what a disk file or a Redis value holds.

    magic "KVRB" | format version (u16) | header length (u32) | header (JSON) | payload | xxh3-128 of all before

The header names everything needed to trust the payload without asking anybody: the model fingerprint the KV
was computed with, the block's hash, parent hash, namespace and tokens (a reader compares them with what it
wanted, as the radix tree compares tokens), the block size, the hash algorithm and the KV layout (dtype,
shape, layer count). A blob whose checksum, fingerprint, layout or tokens disagree is never served."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"KVRB"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_CHECKSUM_BYTES = 16


class BadBlob(ValueError):
    """The bytes are not a block this server may use (damaged, truncated, another model or layout)."""


@dataclass(frozen=True)
class BlockEntry:
    """A block's identity and its KV bytes (a row of KVPool.export_blocks: uint8, 1-D, on the CPU; the rows
    of one export share one buffer). Demoted from a CUDA pool, the bytes may still be on their way (`copied`,
    the pool's StagedCopy): read them through payload()."""

    hash: bytes
    parent_hash: bytes
    tokens: bytes  # little-endian int32
    namespace: bytes
    kv: torch.Tensor
    copied: "StagedCopy | None" = None  # reuse_server.kv.pool.StagedCopy

    @property
    def nbytes(self) -> int:
        return self.kv.numel()

    def payload(self) -> torch.Tensor:
        """The KV bytes, once the copy that fills them has finished."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.kv


@dataclass(frozen=True)
class BlobContext:
    """What every blob of this server must agree with."""

    fingerprint: str  # hex of the model fingerprint's identity (and "-<dtype>" for blocks stored in another dtype)
    block_size: int
    hash_algo: str
    layout: dict  # KVPool.layout.describe()
    kv_bytes: int  # the payload's length

    @property
    def name(self) -> str:
        """A short name for this context's blocks (a folder, a key prefix): the fingerprint's first 16 hex
        digits, and the dtype blocks are stored in where it is not the pool's own."""
        digest, _, dtype = self.fingerprint.partition("-")
        return digest[:16] + (f"-{dtype}" if dtype else "")


def encode(entry: BlockEntry, ctx: BlobContext) -> bytes:
    header = json.dumps({
        "fingerprint": ctx.fingerprint, "hash": entry.hash.hex(), "parent": entry.parent_hash.hex(),
        "namespace": entry.namespace.hex(), "tokens": entry.tokens.hex(), "block_size": ctx.block_size,
        "hash_algo": ctx.hash_algo, "layout": ctx.layout, "payload_bytes": entry.nbytes,
    }, sort_keys=True).encode()
    body = b"".join((_PREFIX.pack(MAGIC, VERSION, len(header)), header, entry.payload().numpy().tobytes()))
    return body + xxhash.xxh3_128_digest(body)


def decode(blob: bytes | memoryview, ctx: BlobContext, expected_hash: bytes | None = None) -> BlockEntry:
    """The entry in `blob`, checked against ctx (and the hash it was looked up by); BadBlob otherwise."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size + _CHECKSUM_BYTES:
        raise BadBlob("truncated")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BadBlob("not a KV block blob")
    if version != VERSION:
        raise BadBlob(f"format version {version}, this server reads {VERSION}")
    body, checksum = view[:-_CHECKSUM_BYTES], view[-_CHECKSUM_BYTES:]
    if xxhash.xxh3_128_digest(body) != bytes(checksum):
        raise BadBlob("checksum mismatch")
    start = _PREFIX.size
    try:
        header = json.loads(bytes(view[start:start + header_len]))
    except ValueError as exc:
        raise BadBlob(f"unreadable header: {exc}") from None
    payload = body[start + header_len:]
    if header.get("fingerprint") != ctx.fingerprint:
        raise BadBlob("computed by another model (fingerprint differs)")
    if (header.get("block_size"), header.get("hash_algo"), header.get("layout")) != (
            ctx.block_size, ctx.hash_algo, ctx.layout):
        raise BadBlob("another block size, hash algorithm or KV layout")
    if header.get("payload_bytes") != len(payload) or len(payload) != ctx.kv_bytes:
        raise BadBlob("payload length disagrees")
    entry = BlockEntry(bytes.fromhex(header["hash"]), bytes.fromhex(header["parent"]),
                       bytes.fromhex(header["tokens"]), bytes.fromhex(header["namespace"]),
                       torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if expected_hash is not None and entry.hash != expected_hash:
        raise BadBlob("holds another block")
    return entry
