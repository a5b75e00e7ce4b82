"""A real redis-server on a free loopback port (Debian's; `make test` installs it), started and stopped by
the tests: no persistence, as the README tells users to run it."""
from __future__ import annotations

import shutil
import subprocess
import time
from contextlib import contextmanager

import redis

from reuse_server.launcher import free_port


class RedisServer:
    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (make test installs Debian's redis-server)"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory", "512mb",
                                      "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not come up")
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)


@contextmanager
def redis_server():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()
