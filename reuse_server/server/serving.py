"""uvicorn with a graceful drain on SIGTERM (and Ctrl+C).

uvicorn's own handling stops listening at once and re-raises the signal after its shutdown, so the process
ends killed by SIGTERM rather than with status 0, and clients arriving meanwhile get connection errors.
Here the first signal starts a drain instead: the server keeps listening but refuses new requests with 503
and Retry-After (and /health says "draining", so a load balancer routes elsewhere), lets the requests in
flight finish for up to `shutdown_timeout` seconds, fails the rest (a stream ends with an error event), and
only then lets uvicorn shut down; the app's lifespan stops the engine, whose close() runs last (the hook for
flushing KV tier writes). The process exits 0. A second signal stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from reuse_server.engine.request_errors import ServerDraining

log = logging.getLogger("reuse_server.server.serving")

# uvicorn's wait for connections after the drain: only the responses of requests that just ended or were
# failed are still being written by then.
CONNECTIONS_GRACE_SECONDS = 5.0
POLL_SECONDS = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float) -> None:
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = CONNECTIONS_GRACE_SECONDS
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        # A signal handler: only flags here; on_tick (every 0.1 s on the loop) starts the drain.
        if not self._drain_requested and not self.should_exit:
            self._drain_requested = True
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        started = time.monotonic()
        self.engine.begin_drain()
        log.warning("shutting down: refusing new requests, waiting up to %g s for %d in flight "
                    "(signal again to stop now)", self.shutdown_timeout, self.engine.num_requests)
        deadline = started + self.shutdown_timeout
        while self.engine.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        left = self.engine.num_requests
        if left:
            log.warning("aborting %d requests still running after %g s", left, self.shutdown_timeout)
            self.engine.fail_all(ServerDraining("the server shut down before the request finished"))
        log.warning("drained in %.2f s", time.monotonic() - started)
        self.should_exit = True
