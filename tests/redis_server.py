"""A real redis-server on a free loopback port (Debian's; `make test` installs it), started and stopped by
the tests, run as docs/operations.md tells users to (reuse_server.server.launcher.redis_process). `kill` and `start` again
on the same port simulate an outage."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

import redis

from reuse_server.server.launcher import free_port, redis_process


class RedisServer:
    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._stack: ExitStack | None = None

    def start(self) -> "RedisServer":
        self._stack = ExitStack()
        self._stack.enter_context(redis_process(self.port))
        return self

    def kill(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)


@contextmanager
def redis_server():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()
