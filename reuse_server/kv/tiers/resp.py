"""Pipelined MGETs whose values are read off the socket straight into a tier's read buffer.

redis-py (without hiredis, as installed here) reads a large bulk string in pieces and joins them, and a blob
is then copied once more out of the bytes object: three copies of every payload, at well under a tenth of
what loopback carries. Here redis-py still connects, authenticates and sends; only the replies are read by
this module: for each value its head and checksum into small buffers and its payload (the last
ctx.kv_bytes before the checksum, tiers/blob.py) into a row of the read buffer with one readinto, which the
socket fills directly. Each value is handed to `on_value` as soon as it has been read, so it can be checked
while the next one arrives."""
from __future__ import annotations

from typing import Callable

import redis
import torch

from reuse_server.kv.tiers.blob import CHECKSUM_BYTES, BadBlob, BlobContext, head_length

IN_FLIGHT = 2  # MGETs sent ahead of the reply being read: more would have Redis build them all before sending
READ_CHUNK = 1 << 16  # the socket reader's buffer: reply headers and small heads come through it


def mget_into(client: redis.Redis, batches: list[list[bytes]], rows: list[torch.Tensor], ctx: BlobContext,
              on_value: Callable[[int, bytearray | None, bytearray | None], None]) -> None:
    """Send one MGET per batch of keys, pipelined (IN_FLIGHT ahead), and read the replies: the i-th key's value's payload
    goes into rows[i], and on_value(i, head, checksum) is called for each key (head None: no such key;
    checksum None: a value that cannot be a blob of ctx, already discarded). A connection error or a
    timeout raises redis.ConnectionError; the connection is then dropped, never reused mid-reply."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        for n, keys in enumerate(batches[:IN_FLIGHT]):  # a health check (a PING read back) only before the first
            conn.send_packed_command(conn.pack_command("MGET", *keys), check_health=n == 0)
        with conn._sock.makefile("rb", buffering=READ_CHUNK) as reader:
            i = 0
            for n, keys in enumerate(batches):
                if n + IN_FLIGHT < len(batches):  # Redis builds the next reply while this one is read
                    conn.send_packed_command(conn.pack_command("MGET", *batches[n + IN_FLIGHT]), check_health=False)
                count = _header(reader, b"*")
                if count != len(keys):
                    raise redis.ConnectionError(f"MGET of {len(keys)} keys answered with {count} values")
                for _ in range(count):
                    _value(reader, rows[i], ctx, i, on_value)
                    i += 1
    except (OSError, ValueError) as exc:  # a timeout, a reset, a garbled length: the reply is lost
        conn.disconnect()
        raise redis.ConnectionError(str(exc)) from exc
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _value(reader, row: torch.Tensor, ctx: BlobContext, i: int, on_value) -> None:
    length = _header(reader, b"$", nil_ok=True)
    if length is None:
        on_value(i, None, None)
        return
    try:
        head = bytearray(head_length(length, ctx))
    except BadBlob:  # too short to be a block: read past it
        _exactly(reader, memoryview(bytearray(length + 2)))
        on_value(i, bytearray(), None)
        return
    tail = bytearray(CHECKSUM_BYTES + 2)
    _exactly(reader, memoryview(head))
    _exactly(reader, memoryview(row.numpy()))
    _exactly(reader, memoryview(tail))
    if tail[-2:] != b"\r\n":
        raise redis.ConnectionError("a bulk string without its line end")
    on_value(i, head, tail[:CHECKSUM_BYTES])


def _header(reader, kind: bytes, nil_ok: bool = False) -> int | None:
    line = reader.readline(READ_CHUNK)
    if not line.endswith(b"\r\n"):
        raise redis.ConnectionError("connection closed in a reply")
    if line[:1] == b"-":
        raise redis.ResponseError(line[1:-2].decode(errors="replace"))
    if nil_ok and (line[:1] == b"_" or line == b"$-1\r\n"):
        return None
    if line[:1] != kind:
        raise redis.ConnectionError(f"unexpected reply {line[:40]!r}")
    return int(line[1:-2])


def _exactly(reader, view: memoryview) -> None:
    while len(view):
        got = reader.readinto(view)
        if not got:
            raise redis.ConnectionError("connection closed in a value")
        view = view[got:]
