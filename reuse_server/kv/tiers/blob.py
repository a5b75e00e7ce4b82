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
CHECKSUM_BYTES = 16


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
    kv: torch.Tensor | None  # None: read straight into the pool block the reader was given (KVTiers.fetch's into)
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


def split(blob: bytes | memoryview, ctx: BlobContext) -> tuple[memoryview, memoryview, memoryview]:
    """(head: magic to the end of the header, payload, checksum) of a blob of ctx's payload length; BadBlob
    when it cannot be one. Readers that place the payload themselves (disk.py, remote.py: straight into a
    read buffer) cut a blob the same way: the payload is the last ctx.kv_bytes before the checksum."""
    view = memoryview(blob)
    head = len(view) - ctx.kv_bytes - CHECKSUM_BYTES
    if head < _PREFIX.size:
        raise BadBlob("truncated")
    return view[:head], view[head:head + ctx.kv_bytes], view[head + ctx.kv_bytes:]


def head_length(blob_length: int, ctx: BlobContext) -> int:
    """How many bytes come before the payload in a blob `blob_length` long; BadBlob when it is too short."""
    head = blob_length - ctx.kv_bytes - CHECKSUM_BYTES
    if head < _PREFIX.size:
        raise BadBlob("truncated")
    return head


def decode(blob: bytes | memoryview, ctx: BlobContext, expected_hash: bytes | None = None) -> BlockEntry:
    """The entry in `blob`, checked against ctx (and the hash it was looked up by); BadBlob otherwise."""
    if len(blob) < _PREFIX.size + CHECKSUM_BYTES:
        raise BadBlob("truncated")
    _check_prefix(memoryview(blob))
    head, payload, checksum = split(blob, ctx)
    return check(head, torch.frombuffer(bytearray(payload), dtype=torch.uint8), checksum, ctx, expected_hash)


def _check_prefix(head: memoryview) -> int:
    magic, version, header_len = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise BadBlob("not a KV block blob")
    if version != VERSION:
        raise BadBlob(f"format version {version}, this server reads {VERSION}")
    return header_len


def check(head: bytes | memoryview, payload: "torch.Tensor | list", checksum: bytes | memoryview, ctx: BlobContext,
          expected_hash: bytes | None = None) -> BlockEntry:
    """The entry a blob's three parts make, checked as `decode` checks a whole blob; BadBlob otherwise. The
    payload is uint8 [ctx.kv_bytes] on the CPU, which becomes the entry's kv as it is (no copy), or the pieces
    it was read into, in order (numpy arrays, KVPool.read_targets: a pool block's memory; the entry's kv is
    then None). The checksum runs over the head and the payload where they lie."""
    head = memoryview(head)
    if len(head) < _PREFIX.size:
        raise BadBlob("truncated")
    header_len = _check_prefix(head)
    digest = xxhash.xxh3_128(head)
    if isinstance(payload, torch.Tensor):
        digest.update(payload.numpy())
        length = payload.numel()
    else:
        for piece in payload:
            digest.update(piece)
        length = sum(piece.nbytes for piece in payload)
    if digest.digest() != bytes(checksum):
        raise BadBlob("checksum mismatch")
    if _PREFIX.size + header_len != len(head):
        raise BadBlob("payload length disagrees")
    try:
        header = json.loads(bytes(head[_PREFIX.size:]))
    except ValueError as exc:
        raise BadBlob(f"unreadable header: {exc}") from None
    if header.get("fingerprint") != ctx.fingerprint:
        raise BadBlob("computed by another model (fingerprint differs)")
    if (header.get("block_size"), header.get("hash_algo"), header.get("layout")) != (
            ctx.block_size, ctx.hash_algo, ctx.layout):
        raise BadBlob("another block size, hash algorithm or KV layout")
    if header.get("payload_bytes") != length or length != ctx.kv_bytes:
        raise BadBlob("payload length disagrees")
    entry = BlockEntry(bytes.fromhex(header["hash"]), bytes.fromhex(header["parent"]),
                       bytes.fromhex(header["tokens"]), bytes.fromhex(header["namespace"]),
                       payload if isinstance(payload, torch.Tensor) else None)
    if expected_hash is not None and entry.hash != expected_hash:
        raise BadBlob("holds another block")
    return entry
