"""Pipelined MGETs whose values are read off the socket straight where they go: the pool's blocks, or a tier's
read buffer.

redis-py (without hiredis, as installed here) reads a large bulk string in pieces and joins them, and a blob
is then copied once more out of the bytes object: three copies of every payload, at well under a tenth of
what loopback carries. Here redis-py still connects, authenticates and sends; only the replies are read by
this module: for each value its head and checksum into small buffers and its payload (the last
ctx.kv_bytes before the checksum, tiers/blob.py) where the caller wants it: the pieces of the pool block it goes
to (KVPool.read_targets), or a row of a read buffer. On a plain TCP or Unix socket a value is received with
recvmsg_into, which scatters it into all of those buffers in one system call (the kernel copies each byte
once, straight where it goes; only reply lines pass through a small buffer); over TLS, through a buffered
reader, one readinto per buffer. Each value is handed to `on_value` as soon as it has been read (the caller
checks it there, while the kernel takes in what follows)."""
from __future__ import annotations

import socket
import ssl
from typing import Callable

import redis

from reuse_server.kv.tiers.blob import CHECKSUM_BYTES, BadBlob, BlobContext, head_length

IN_FLIGHT = 2  # MGETs sent ahead of the reply being read: more would have Redis build them all before sending
READ_CHUNK = 1 << 16  # the buffered reader's buffer (TLS): reply headers and small heads come through it
LINE_CHUNK = 1 << 12  # the scatter reader's: a reply line and what follows it in the same packet
MAX_SCATTER = 1024  # buffers one recvmsg_into fills at most (IOV_MAX on Linux)


def mget_into(client: redis.Redis, batches: list[list[bytes]], targets: list[list], ctx: BlobContext,
              on_value: Callable[[int, bytearray | None, bytearray | None], None]) -> None:
    """Send one MGET per batch of keys, pipelined (IN_FLIGHT ahead), and read the replies: the i-th key's value's
    payload goes into the writable buffers targets[i], in order (a row of a read buffer, or the pieces of a pool
    block's memory), and on_value(i, head, checksum) is called for each key (head None: no such key;
    checksum None: a value that cannot be a blob of ctx, already discarded). A connection error or a
    timeout raises redis.ConnectionError; the connection is then dropped, never reused mid-reply."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        for n, keys in enumerate(batches[:IN_FLIGHT]):  # a health check (a PING read back) only before the first
            conn.send_packed_command(conn.pack_command("MGET", *keys), check_health=n == 0)
        sock = conn._sock
        plain = isinstance(sock, socket.socket) and not isinstance(sock, ssl.SSLSocket)
        if plain and hasattr(sock, "recvmsg_into"):
            reading = _ScatterReader(sock)
        else:
            reading = _BufferedReader(sock.makefile("rb", buffering=READ_CHUNK))
        with reading as reader:
            i = 0
            for n, keys in enumerate(batches):
                if n + IN_FLIGHT < len(batches):  # Redis builds the next reply while this one is read
                    conn.send_packed_command(conn.pack_command("MGET", *batches[n + IN_FLIGHT]), check_health=False)
                count = _header(reader, b"*")
                if count != len(keys):
                    raise redis.ConnectionError(f"MGET of {len(keys)} keys answered with {count} values")
                for _ in range(count):
                    _value(reader, targets[i], ctx, i, on_value)
                    i += 1
    except (OSError, ValueError) as exc:  # a timeout, a reset, a garbled length: the reply is lost
        conn.disconnect()
        raise redis.ConnectionError(str(exc)) from exc
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _value(reader, target: list, ctx: BlobContext, i: int, on_value) -> None:
    length = _header(reader, b"$", nil_ok=True)
    if length is None:
        on_value(i, None, None)
        return
    try:
        head = bytearray(head_length(length, ctx))
    except BadBlob:  # too short to be a block: read past it
        reader.fill([bytearray(length + 2)])
        on_value(i, bytearray(), None)
        return
    tail = bytearray(CHECKSUM_BYTES + 2)
    reader.fill([head, *target, tail])
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


class _BufferedReader:
    """A buffered file over the socket (what a TLS connection is read through)."""

    def __init__(self, file):
        self._file = file

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def readline(self, limit: int) -> bytes:
        return self._file.readline(limit)

    def fill(self, buffers: list) -> None:
        """Fill each writable buffer in turn with the next bytes."""
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            while len(view):
                got = self._file.readinto(view)
                if not got:
                    raise redis.ConnectionError("connection closed in a value")
                view = view[got:]


class _ScatterReader:
    """Reads a plain socket: reply lines through a small buffer, values scattered straight into the caller's
    buffers with recvmsg_into (what a line's read brought along of the value after it goes from the small
    buffer into the value's buffers first)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buf = bytearray(LINE_CHUNK)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the bytes received and not yet handed out: _buf[_start:_end]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._view.release()

    def readline(self, limit: int) -> bytes:
        while True:
            end = self._buf.find(b"\n", self._start, self._end)
            if end >= 0 or self._end - self._start >= limit:
                end = end + 1 if end >= 0 else self._end
                line = bytes(self._view[self._start:end])
                self._start = end
                return line
            if not self._receive():
                return bytes(self._view[self._start:self._end])  # closed: not a whole line

    def _receive(self) -> int:
        if self._start:
            kept = self._end - self._start
            self._buf[:kept] = self._view[self._start:self._end]
            self._start, self._end = 0, kept
        if self._end == len(self._buf):
            return 0
        got = self._sock.recv_into(self._view[self._end:])
        self._end += got
        return got

    def fill(self, buffers: list) -> None:
        """Fill each writable buffer in turn with the next bytes: first what is buffered, then the socket's,
        scattered into all of them at once."""
        views = [memoryview(b).cast("B") for b in buffers]
        k = 0
        while k < len(views) and self._start < self._end:
            n = min(len(views[k]), self._end - self._start)
            views[k][:n] = self._view[self._start:self._start + n]
            self._start += n
            if n == len(views[k]):
                k += 1
            else:
                views[k] = views[k][n:]
        while k < len(views):
            got = self._sock.recvmsg_into(views[k:k + MAX_SCATTER])[0]
            if not got:
                raise redis.ConnectionError("connection closed in a value")
            while got:
                if got >= len(views[k]):
                    got -= len(views[k])
                    k += 1
                else:
                    views[k] = views[k][got:]
                    got = 0
