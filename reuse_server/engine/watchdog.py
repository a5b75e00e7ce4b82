"""Notices an engine thread that has stopped making progress (a step that does not return: a kernel deadlock,
a stuck tier read) while work waits for it.

The engine thread calls `beat()` every time round its loop (after each step, and at least every half second
while idle). A thread of its own checks the time since the last beat: past `timeout` seconds with work queued,
the engine is *stalled*: `on_stall(reason)` runs once (the async engine fails the requests in flight and
refuses new ones, and /health answers 503, so a gateway routes elsewhere). Nothing can interrupt a step
that does not return, so the stalled step keeps its thread; if it returns after all, the next beat ends the
stall and `on_recover()` runs (the KV is consistent: the step finished). The watchdog thread is the only
writer of the stall."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT = 60.0  # seconds; longer than any step of a bounded batch, even a cold first one
MAX_CHECK_SECONDS = 1.0


class Watchdog:
    def __init__(self, timeout: float, has_work: Callable[[], bool], on_stall: Callable[[str], None],
                 on_recover: Callable[[], None] = lambda: None) -> None:
        if timeout <= 0:
            raise ValueError(f"the step timeout must be positive, got {timeout}")
        self.timeout = timeout
        self._has_work = has_work
        self._on_stall = on_stall
        self._on_recover = on_recover
        self._last_beat = time.monotonic()
        self._beats = 0
        self.stalled_reason: str | None = None
        self.stalls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """The engine thread made progress (called from it only)."""
        self._last_beat = time.monotonic()
        self._beats += 1

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _watch(self) -> None:
        interval = min(MAX_CHECK_SECONDS, self.timeout / 4)
        stalled_at_beat = 0
        while not self._stop.wait(interval):
            if self.stalled_reason is not None:
                if self._beats != stalled_at_beat:
                    log.warning("the engine made progress again after a stall; serving again")
                    self.stalled_reason = None
                    self._on_recover()
                continue
            beats, idle = self._beats, time.monotonic() - self._last_beat
            if idle > self.timeout and self._has_work():
                stalled_at_beat = beats
                self.stalls += 1
                self.stalled_reason = (f"the engine made no progress for {idle:.0f} s with work queued "
                                       f"(--step-timeout {self.timeout:g} s): a step has not returned")
                log.error("%s; failing the requests in flight and refusing new ones", self.stalled_reason)
                self._on_stall(self.stalled_reason)
