"""A tier's background writer: blocks to store wait in a queue bounded in bytes and are written by one
thread, so storing never blocks a request; past the bound new blocks are dropped (and counted), never
waited for. `mark()` and `settled(mark)` tell whether every block handed over before the mark has been
written (or dropped), for a caller that must not answer before then."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.stats import TierStats

log = logging.getLogger(__name__)

MAX_BATCH = 32


class BackgroundWriter:
    def __init__(self, name: str, write: Callable[[list[BlockEntry]], None], stats: TierStats, max_bytes: int):
        self.name = name
        self._write = write  # stores a batch; raises only on a bug (tiers count and log their own failures)
        self.stats = stats
        self.max_bytes = max_bytes
        self._queue: deque[BlockEntry] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._closing = False
        self._handed = 0  # blocks given to put() so far
        self._done = 0  # ... of which written or dropped
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name}-writer", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def mark(self) -> int:
        with self._cond:
            return self._handed

    def settled(self, mark: int, timeout: float = 0.0) -> bool:
        """Whether every block handed over before `mark` is written or dropped, waiting up to `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done < mark:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def put(self, entries: list[BlockEntry]) -> None:
        with self._cond:
            self._handed += len(entries)
            for entry in entries:
                if self._closing or self._queued_bytes + entry.nbytes > self.max_bytes:
                    self.stats.dropped_writes += 1
                    self._done += 1
                    continue
                self._queue.append(entry)
                self._queued_bytes += entry.nbytes
            self._cond.notify_all()  # the writer thread, among callers waiting in settled()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued block is written; False if `timeout` seconds were not enough."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Write what is queued (up to `timeout` seconds), then stop the thread."""
        done = self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.1, timeout))
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
                self._busy = True
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 - a writer bug must not kill the thread silently
                log.exception("%s writer failed on a batch of %d blocks", self.name, len(batch))
                self.stats.errors += 1
            finally:
                with self._cond:
                    self._queued_bytes -= sum(e.nbytes for e in batch)
                    self._done += len(batch)
                    self._busy = False
                    self._cond.notify_all()
