"""`reuse-server serve` in a subprocess on a free loopback port, for tests, benchmarks and scripts that need
a real server: the caller gets its base URL once /health answers, and the process is stopped on the way out."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def own_session() -> None:
    """In the child, before exec: a session of its own (the terminal's Ctrl+C does not reach it; its owner
    stops it in its own order), and, on Linux, SIGTERM when the owner dies, so that a killed owner leaves no
    orphan behind."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# The flags that size the KV pool; without one a server sizes it from the machine (kv/sizing.py)
POOL_FLAGS = ("--kv-cache-memory", "--num-gpu-blocks")
# The pool of a server a test or benchmark starts without saying: the default before the pool was sized to the
# machine, so that several such servers at once (CI: 2 cores, maybe 8 GiB) do not each take a share of it.
SMALL_POOL = "1GiB"


def names_pool(serve_args: list[str]) -> bool:
    """Whether serve_args size the KV pool themselves."""
    return any(arg.split("=", 1)[0] in POOL_FLAGS for arg in serve_args)


def with_small_pool(serve_args: list[str]) -> list[str]:
    """serve_args, with --kv-cache-memory SMALL_POOL where they name no pool size."""
    return list(serve_args) if names_pool(serve_args) else [*serve_args, "--kv-cache-memory", SMALL_POOL]


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(serve_args: list[str], log_path: Path, startup_timeout: float = 300.0,
           cwd: Path | None = None, new_session: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (base URL, process) of `reuse-server serve *serve_args` (port and log level chosen here);
    its output goes to log_path. new_session: the server does not get the terminal's Ctrl+C (its owner stops
    it, in its own order) and gets SIGTERM if its owner dies."""
    port = free_port()
    cmd = [sys.executable, "-m", "reuse_server.server.cli", "serve", "--port", str(port), "--log-level", "warning",
           *serve_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=own_session if new_session else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path, startup_timeout)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)  # a drain waits up to --shutdown-timeout (default 30 s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log_path: Path, chars: int = 3000) -> str:
    return Path(log_path).read_text()[-chars:]


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float, name: str = "server") -> None:
    """Returns once GET url/health answers 200; ServerStartError (with the log's tail) if the process exits
    first or timeout seconds pass."""
    # imported here, not at the top: `reuse-server serve` imports this module for its flags, and httpx
    # brings rich, click and pygments (its command line) with it
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerStartError(f"{name} exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"{name} did not come up in {timeout:g} s:\n{_tail(log_path)}")
        time.sleep(0.2)


@contextmanager
def redis_process(port: int | None = None, maxmemory: str = "1gb",
                  new_session: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """A local redis-server (Debian's `redis-server` on PATH) on a free loopback port, run as docs/operations.md tells
    users to run it for the KV tier: no persistence, an LRU memory bound. Yields (URL, process)."""
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise ServerStartError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = port or free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=own_session if new_session else None)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ServerStartError(f"redis-server on port {port} did not come up") from None
                time.sleep(0.05)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()
