"""`reuse-server dynamo-worker` behind NVIDIA Dynamo 1.6.1's own frontend (`python -m dynamo.frontend
--router-mode kv`), all on loopback without etcd or NATS (file discovery, TCP request plane, ZMQ event
plane): two of our workers register the tiny checkpoint, the frontend tokenizes and routes, and a prompt that
continues one a worker computed goes to that worker (Dynamo's KV router knows it only from the KV events our
engine publishes and the worker relays) and is served from its cache. Which worker served a request is read
from each worker's Dynamo metrics (DYN_SYSTEM_PORT).

`make test` installs Dynamo (ai-dynamo-runtime through the dynamo extra, ai-dynamo without its NVIDIA-only
dependencies), so the test runs wherever the suite does."""
from __future__ import annotations

import os
import socket
import random
import subprocess
import sys
import time

import httpx
import pytest

from reuse_server.server.launcher import free_port
from server_process import REPO

import dynamo.llm  # noqa: F401  (installed by make; an ImportError here is a broken set-up, not a skip)
import msgspec  # noqa: F401  (dynamo.frontend needs it)

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
SEED = 20261201
WORDS = "river salt wool grain trader spring market bridge tower harbor winter lantern copper meadow".split()


def text(seed: int, words: int = 15) -> str:
    rng = random.Random(SEED + seed)
    print("text seed", SEED + seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def wait(ok, what: str, procs, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for name, proc, log in procs:
            assert proc.poll() is None, f"{name} exited:\n{log.read_text()[-3000:]}"
        try:
            if ok():
                return
        except (httpx.TransportError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.3)


def system_port() -> int:
    """A free port Dynamo takes for DYN_SYSTEM_PORT: 1.6.1 parses it as an i16, so below 32768."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def worker_requests(port: int) -> float:
    text_ = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text_.splitlines():
        if line.startswith("dynamo_component_requests_total{") and 'dynamo_endpoint="generate"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def dynamo(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamo")
    env = dict(os.environ, DYN_FILE_KV=str(root / "kv"), DYN_TCP_RPC_HOST="127.0.0.1",
               DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
               DYN_SYSTEM_HOST="127.0.0.1", DYN_SYSTEM_ENABLED="true", HOME=str(root))
    procs, ports = [], []
    try:
        for i in range(2):
            port = system_port()
            log = root / f"worker-{i}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "reuse_server.server.cli", "dynamo-worker", "--", "--model",
                     str(tiny_llama_path), "--served-model-name", "tiny", "--block-size", str(BS),
                     "--num-gpu-blocks", "64", "--no-blend-key-shift"],
                    cwd=REPO, env=dict(env, DYN_SYSTEM_PORT=str(port)), stdout=out, stderr=subprocess.STDOUT)
            procs.append((f"worker {i}", proc, log))
            ports.append(port)
        http_port = free_port()
        log = root / "frontend.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(http_port),
                 "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                 "--router-mode", "kv"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append(("frontend", proc, log))
        url = f"http://127.0.0.1:{http_port}"
        for port in ports:
            wait(lambda: httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ready",
                 "a worker's start", procs)
        # the frontend has found both workers (its log says so) and serves the model
        wait(lambda: log.read_text().count("Adding worker WorkerWithDpRank") >= 2
             and httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny",
             "the frontend's discovery of both workers", procs)
        yield url, ports
    finally:
        for _, proc, _ in reversed(procs):
            proc.terminate()
        for _, proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for name, _, log in procs[:2]:
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served_by(ports, before) -> int:
    grew = [i for i, port in enumerate(ports) if worker_requests(port) > before[i]]
    assert len(grew) == 1, grew
    return grew[0]


@pytest.mark.parametrize("k", range(4))
def test_a_continued_prompt_goes_to_the_worker_holding_it(dynamo, k):
    url, ports = dynamo
    prompt = f"{k} {text(k)}"  # apart from the others' from the first block on
    before = [worker_requests(p) for p in ports]
    first = complete(url, prompt)
    holder = served_by(ports, before)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(0.5)  # the events go worker -> Dynamo's relay -> the router on their own schedule (a margin)
    before = [worker_requests(p) for p in ports]
    second = complete(url, prompt + " and then the harbor")
    assert served_by(ports, before) == holder
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= BS
