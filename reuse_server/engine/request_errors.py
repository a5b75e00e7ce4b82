"""Why the async engine refuses or ends a request; the API maps each to an HTTP status (api/errors.py).
Torch-free, so that the HTTP layer can name them without loading the engine."""
from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine takes no new work (dead or draining); the API answers 503."""


class EngineDeadError(EngineUnavailable):
    """The engine thread has stopped (a failed step, or it was shut down); requests in it failed."""


class EngineStalled(EngineUnavailable):
    """The engine thread made no progress for --step-timeout seconds with work queued (engine/watchdog.py):
    requests in flight failed and new ones are refused until a step returns."""


class ServerDraining(EngineUnavailable):
    """The server is shutting down: in-flight requests may finish, new ones are refused."""


class QueueFull(RuntimeError):
    """More requests would wait than --max-waiting allows; the API answers 429."""

    def __init__(self, waiting: int, limit: int, wanted: int):
        super().__init__(f"The server is at capacity: {waiting} requests are waiting (the limit is {limit}) "
                         f"and this one adds {wanted}. Retry later.")
        self.waiting, self.limit, self.wanted = waiting, limit, wanted


class RequestTimedOut(RuntimeError):
    """The request ran past its deadline (--request-timeout) and was aborted."""
