"""What the disk and Redis tiers read blocks with: a buffer the payloads land in where they cannot land in the
pool itself.

- A hit reads payloads straight into the pool blocks taken for them (KVPool.read_targets, KVTiers.fetch's
  `into`): no buffer, no copy after, and no fresh memory to fault in (on this VM a fresh 188 MB buffer cost
  270-570 ms of page faults, more than the read: a fresh server's first hit, and any read larger than the
  buffer kept, paid it).
- `ReadBuffer`, for the other reads (a pool that cannot take them in place: an 8-bit pool's scales, another
  tier dtype, a hybrid model's pool, a CUDA pool; reads without a destination): payloads are read straight
  into rows of one buffer that is reused from read to read. A fresh buffer per read would cost more than the
  copy into it (the kernel maps and zeroes every page of a few hundred megabytes on first touch); rows of one
  buffer are also what the pool imports in one copy (KVPool.import_rows). A caller may keep the rows it was
  given as long as it likes: while any row of the last read is still alive, the next read gets a new buffer.

Each block is checked on the reading thread as soon as it is in. A second thread checking block i while block
i + 1 was read lost more than it overlapped (BENCHMARKS.md, KV tiers): a payload read into the pool lies in one
piece per layer's K or V, each piece's xxhash update hands the GIL over, and the two threads traded it tens of
thousands of times a long read."""
from __future__ import annotations

import weakref

import torch

KEEP_AT_MOST = 1 << 28  # bytes of buffer kept for the next read (a 4,096-token prompt of the bundled model: 188 MB); a larger read's buffer goes with its rows


class ReadBuffer:
    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes
        self._buffer: torch.Tensor | None = None
        self._handed: list[weakref.ref] = []

    def _allocate(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.row_bytes), dtype=torch.uint8)

    def rows(self, n: int) -> list[torch.Tensor]:
        """n rows (uint8 [row_bytes] each) that nothing else uses, adjacent in memory in order."""
        if self._buffer is None or self._buffer.shape[0] < n or any(r() is not None for r in self._handed):
            self._buffer = self._allocate(n)
        rows = list(self._buffer[:n].unbind(0))
        if self._buffer.numel() > KEEP_AT_MOST:
            self._buffer, self._handed = None, []
        else:
            self._handed = [weakref.ref(r) for r in rows]
        return rows

    def destinations(self, hashes: list[bytes], into: dict[bytes, list] | None) -> tuple[list, list[list]]:
        """Where each block's payload is read (a tier's get): (payloads, targets) per hash. With `into` (the pool
        blocks' memory, KVPool.read_targets) both are its buffers; without, a row of this buffer each, and the
        writable view to read it through."""
        if into is not None:
            targets = [into[h] for h in hashes]
            return targets, targets
        payloads = self.rows(len(hashes))
        return payloads, [[row.numpy()] for row in payloads]


class PinnedReadBuffer(ReadBuffer):
    """ReadBuffer for a CUDA pool: rows in pinned host memory, which the pool copies to the device
    asynchronously (KVPool.import_blocks through kv.pool.HostUploads: a pageable source would be staged by the
    driver synchronously); before its rows are handed out again, the last copy out of them has finished."""

    def __init__(self, row_bytes: int, device: torch.device):
        super().__init__(row_bytes)
        from reuse_server.kv.pool import HostUploads

        self.uploads = HostUploads.of(torch.device(device))

    def _allocate(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.row_bytes), dtype=torch.uint8, pin_memory=True)

    def rows(self, n: int) -> list[torch.Tensor]:
        self.uploads.wait()
        return super().rows(n)


def read_buffer(row_bytes: int, device) -> ReadBuffer:
    """The read buffer for a pool on `device`: pinned for a CUDA pool, plain host memory otherwise."""
    device = torch.device(device)
    return PinnedReadBuffer(row_bytes, device) if device.type == "cuda" else ReadBuffer(row_bytes)
