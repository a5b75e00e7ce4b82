"""N `reuse-server dynamo-worker` processes behind NVIDIA Dynamo's own frontend (`python -m dynamo.frontend
--router-mode kv`) on one machine, all on loopback without etcd or NATS: file discovery (DYN_FILE_KV, a folder of
this cluster's own), the TCP request plane and the ZMQ event plane (docs/operations.md, "As NVIDIA Dynamo workers"). For
tests and benchmarks, like `cluster.replica_set` and `cluster.gateway` for the other routers.

Each worker serves Dynamo's system server on a port of its own (DYN_SYSTEM_PORT): /health, and /metrics with
Dynamo's `dynamo_component_*` metrics and the engine's own `kvreuse_*` ones (dynamo_worker bridges them), so
`reuse-loadgen run --replica-metrics` reads a worker there as it reads a `serve` replica's /metrics."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from reuse_server.server.launcher import ServerStartError, free_port, own_session

STOP_SECONDS = 60.0


@dataclass(frozen=True)
class DynamoCluster:
    url: str  # the frontend's base URL (OpenAI API under /v1)
    system_ports: list[int]  # each worker's Dynamo system server: /health, /metrics
    worker_logs: list[Path]
    frontend_log: Path
    worker_processes: list[subprocess.Popen] = ()  # (tests kill one to see what the frontend does)

    @property
    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.system_ports]


def system_port() -> int:
    """A free loopback port for DYN_SYSTEM_PORT: Dynamo 1.6.1 parses it as an i16, so below 32768."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServerStartError("no free port below 32768")


def dynamo_env(root: Path) -> dict[str, str]:
    """The environment of the workers and the frontend: discovery through files under root, every plane on
    loopback, HOME in root (Dynamo keeps the model card it fetched under ~/.cache/dynamo) while the engine's
    own cache (converted models, compiled kernels) stays where it is."""
    from reuse_server.model.cache_dir import default_cache_dir

    return dict(os.environ, DYN_FILE_KV=str(root / "kv"), DYN_TCP_RPC_HOST="127.0.0.1",
                DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
                DYN_SYSTEM_HOST="127.0.0.1", DYN_SYSTEM_ENABLED="true", HOME=str(root),
                KV_REUSE_CACHE_DIR=str(default_cache_dir()), PYTHONUNBUFFERED="1")


@contextmanager
def dynamo_cluster(count: int, serve_args: list[str], log_dir: Path, startup_timeout: float = 300.0,
                   frontend_args: list[str] = ()) -> Iterator[DynamoCluster]:
    """`count` workers (`reuse-server dynamo-worker -- *serve_args`; serve_args must name a model folder with
    --model, since the frontend tokenizes from it) and the frontend with its KV router in front; yields once
    every worker is ready and serves the engine's metrics and the frontend has found every worker and lists the
    model. The processes run in a folder of their own under log_dir, where their logs go too. On the way out
    all get SIGTERM at once (the frontend first) and are waited for (SIGKILL after STOP_SECONDS)."""
    root = Path(tempfile.mkdtemp(prefix="dynamo-", dir=log_dir))
    env = dynamo_env(root)
    procs: list[tuple[str, subprocess.Popen, Path]] = []
    ports, worker_logs = [], []
    try:
        for i in range(count):
            port = system_port()
            log = root / f"worker-{i}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "reuse_server.server.cli", "dynamo-worker", "--", *serve_args],
                    env=dict(env, DYN_SYSTEM_PORT=str(port)), stdout=out, stderr=subprocess.STDOUT,
                    preexec_fn=own_session)
            procs.append((f"dynamo worker {i}", proc, log))
            ports.append(port)
            worker_logs.append(log)
        http_port = free_port()
        frontend_log = root / "frontend.log"
        with open(frontend_log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(http_port),
                 "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                 "--router-mode", "kv", *frontend_args],
                env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=own_session)
        procs.append(("the dynamo frontend", proc, frontend_log))
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + startup_timeout
        for port in ports:
            _wait(lambda: _worker_ready(port), "a worker's start", procs, deadline)
        # the frontend has found every worker (its log says so) and serves the model
        _wait(lambda: frontend_log.read_text().count("Adding worker WorkerWithDpRank") >= count
              and bool(httpx.get(url + "/v1/models", timeout=2).json()["data"]),
              f"the frontend's discovery of {count} workers", procs, deadline)
        yield DynamoCluster(url=url, system_ports=ports, worker_logs=worker_logs, frontend_log=frontend_log,
                            worker_processes=[proc for _, proc, _ in procs[:count]])
    finally:
        for _, proc, _ in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in procs:
            try:
                proc.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _worker_ready(port: int) -> bool:
    base = f"http://127.0.0.1:{port}"
    return (httpx.get(base + "/health", timeout=2).json()["status"] == "ready"
            and "kvreuse_kv_blocks_total" in httpx.get(base + "/metrics", timeout=2).text)


def _wait(ok: Callable[[], bool], what: str, procs, deadline: float) -> None:
    while True:
        for name, proc, log in procs:
            if proc.poll() is not None:
                raise ServerStartError(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if ok():
                return
        except (httpx.TransportError, ValueError, KeyError, IndexError):
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {name}:\n{log.read_text()[-1500:]}" for name, _, log in procs)
            raise ServerStartError(f"{what} did not happen in time:\n{tails}")
        time.sleep(0.3)
