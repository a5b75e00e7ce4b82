"""L2: blocks as files on local disk, one self-describing file per block (tiers/blob.py), that survive a
restart: at start-up the index is rebuilt from the folder, so a restarted server hits what it computed before.

Layout: <dir>/<fingerprint prefix>/<first two hex digits of the hash>/<hash>.kv. Writes go through a
background writer (never blocking a request): a temporary file in the same folder, written, fsynced, then
renamed into place, and the folder fsynced; only then does the index list the block. So a server killed at
any moment leaves at most a temporary file, which start-up deletes, never a half block that is read back.
Reads block the caller; each file's payload is read with one readv straight into the pool block taken for it
(or a reused buffer) and checked while the next file is read (tiers/reads.py). A file that fails its
checksum, is truncated, holds other tokens or belongs to another model is a miss: it is deleted and logged,
never served. Past the size budget the least recently used files are deleted."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from reuse_server.kv.tiers.blob import CHECKSUM_BYTES, BadBlob, BlobContext, BlockEntry, check, encode, head_length
from reuse_server.kv.tiers.reads import ReadBuffer
from reuse_server.kv.tiers.stats import TierStats
from reuse_server.kv.tiers.writer import BackgroundWriter

log = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
READ_AHEAD = 64  # files a read keeps open and asked for ahead of the one it reads (fds and bytes in flight)


def _open_ahead(path: str) -> "int | OSError":
    """The file opened (or why not), its whole read asked for ahead (POSIX_FADV_WILLNEED): files not in the
    page cache are then read by the kernel READ_AHEAD at a time, at the device's queue depth, instead of one
    file's readahead after another's."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return exc
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:  # advice only: a file system that takes none is read as it comes
        pass
    return fd


class DiskTier:
    name = "disk"

    def __init__(self, root: Path, capacity_bytes: int, ctx: BlobContext, max_queue_bytes: int = 256 << 20,
                 reads: ReadBuffer | None = None):
        self.ctx = ctx
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.dir = Path(root) / ctx.name
        self._dir_name = str(self.dir)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recently used first
        self._bytes = 0
        self._lock = threading.Lock()  # the index is shared by the engine thread and the writer
        self._reads = reads or ReadBuffer(ctx.kv_bytes)  # a CUDA pool's is pinned (reads.read_buffer)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._rebuild_index()
        except OSError as exc:  # an unreadable or unwritable folder: the server runs without what it held
            self.stats.errors += 1
            log.error("disk cache %s unusable, going on without what it holds: %s", self.dir, exc)
        self.writer = BackgroundWriter("disk", self._write_batch, self.stats, max_queue_bytes)

    # ---- the index -------------------------------------------------------------------------
    def _rebuild_index(self) -> None:
        files = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.name.startswith(TMP_PREFIX):  # a write that never finished: never read back
                    path.unlink(missing_ok=True)
                    continue
                if path.suffix != SUFFIX:
                    continue
                try:
                    block_hash = bytes.fromhex(path.stem)
                    st = path.stat()
                except (ValueError, OSError):
                    continue
                files.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(files):
            self._index[block_hash] = size
            self._bytes += size
        if files:
            log.info("disk cache %s: %d blocks (%.1f MiB) from earlier runs", self.dir, len(files), self._bytes / 2**20)
        self._evict_over_budget()

    def _path(self, block_hash: bytes) -> Path:
        return Path(self._file(block_hash))

    def _file(self, block_hash: bytes) -> str:
        """_path as a string: a read builds one per block, and pathlib's joins cost more than its open."""
        h = block_hash.hex()
        return os.path.join(self._dir_name, h[:2], h + SUFFIX)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def _forget(self, block_hash: bytes, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._bytes -= size
        if delete:
            self._path(block_hash).unlink(missing_ok=True)

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.capacity_bytes or not self._index:
                    return
                block_hash, size = self._index.popitem(last=False)
                self._bytes -= size
            self._path(block_hash).unlink(missing_ok=True)

    # ---- reads (the caller's thread) -------------------------------------------------------
    def get(self, hashes: list[bytes], contiguous: bool = False,
            into: dict[bytes, list] | None = None) -> dict[bytes, BlockEntry]:
        """contiguous: read up to the first block not held (only an unbroken run is any use). into: where each
        block's payload goes, by hash (KVPool.read_targets: the memory of the pool block the caller took for
        it; the entry's kv is then None); None: rows of the tier's read buffer (what the pool then imports in
        one copy). Files are opened and their reads asked for READ_AHEAD ahead; each is read with one readv
        (its head and checksum into small buffers, its payload straight where it goes) and checked (reads.py
        says why on this thread)."""
        held = []
        for h in hashes:
            if h in self._index:
                held.append(h)
            elif contiguous:
                break
        if not held:
            return {}
        payloads, targets = self._reads.destinations(held, into)
        paths = [self._file(h) for h in held]
        opened: list = [None] * len(paths)  # files opened ahead and not yet read: an fd, or why not
        ahead = 0  # the next file to open
        found = {}
        try:
            for i, (h, path, target, payload) in enumerate(zip(held, paths, targets, payloads)):
                while ahead < min(len(paths), i + READ_AHEAD):
                    opened[ahead] = _open_ahead(paths[ahead])
                    ahead += 1
                fd, opened[i] = opened[i], None
                try:
                    if isinstance(fd, OSError):
                        raise fd
                    head, checksum = self._read_into(fd, target)
                except BadBlob as exc:
                    self._corrupt(h, path, exc)
                    continue
                except OSError as exc:
                    log.warning("disk cache: cannot read %s: %s", path, exc)
                    self.stats.errors += 1
                    self._forget(h, delete=False)
                    continue
                self.stats.read_bytes += len(head) + self.ctx.kv_bytes + len(checksum)
                try:
                    entry = check(head, payload, checksum, self.ctx, h)
                except BadBlob as exc:
                    self._corrupt(h, path, exc)
                    continue
                with self._lock:
                    if h in self._index:
                        self._index.move_to_end(h)
                found[h] = entry
        finally:
            for fd in opened:  # what an exception left unread
                if isinstance(fd, int):
                    os.close(fd)
        return found

    def holds(self, hashes: list[bytes]) -> list[bool]:
        return [h in self._index for h in hashes]

    def _read_into(self, fd: int, target: list) -> tuple[bytearray, bytearray]:
        """(head, checksum) of the block file open at fd (closed here), its payload read into the buffers of
        target, in order."""
        try:
            size = os.fstat(fd).st_size
            head, checksum = bytearray(head_length(size, self.ctx)), bytearray(CHECKSUM_BYTES)
            got = os.readv(fd, [head, *target, checksum])
        finally:
            os.close(fd)
        if got != size:
            raise BadBlob("truncated")
        return head, checksum

    def _corrupt(self, block_hash: bytes, path: "Path | str", exc: BadBlob) -> None:
        log.warning("disk cache: deleting %s: %s", path, exc)
        self.stats.corrupt += 1
        self._forget(block_hash, delete=True)

    def discard(self, block_hash: bytes) -> None:
        """Drop a block (it was found bad by the caller)."""
        self._forget(block_hash, delete=True)

    # ---- writes (the writer thread) --------------------------------------------------------
    def put(self, entries: list[BlockEntry]) -> None:
        self.writer.put([e for e in entries if e.hash not in self._index])

    def _write_batch(self, entries: list[BlockEntry]) -> None:
        written: list[tuple[bytes, int]] = []
        for entry in entries:
            if entry.hash in self._index:
                continue
            path = self._path(entry.hash)
            tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
            start = time.perf_counter()
            try:
                path.parent.mkdir(exist_ok=True)
                blob = encode(entry, self.ctx)
                with open(tmp, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as exc:  # disk full, folder gone or read-only: the block is not kept here
                self.stats.errors += 1
                self.stats.dropped_writes += 1
                if self.stats.errors == 1 or self.stats.errors % 1000 == 0:
                    log.warning("disk cache: cannot write %s (%d failed writes so far): %s", path,
                                self.stats.errors, exc)
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                continue
            self.stats.write_seconds += time.perf_counter() - start
            self.stats.written += 1
            self.stats.written_bytes += len(blob)
            written.append((entry.hash, len(blob)))
        for folder in {self._path(h).parent for h, _ in written}:  # the renames are durable once their folders are
            try:
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError:
                pass
        with self._lock:  # visible only now that they are durable
            for block_hash, size in written:
                self._index[block_hash] = size
                self._bytes += size
        self._evict_over_budget()

    @property
    def write_queue_bytes(self) -> int:
        return self.writer.queued_bytes

    def close(self, timeout: float = 10.0) -> bool:
        return self.writer.close(timeout)
