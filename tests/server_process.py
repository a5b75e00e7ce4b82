"""A real `reuse-server serve` in a subprocess on a free loopback port, and readers of its /metrics."""
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model_path, log_path: Path, *extra_args: str, served_name: str = "tiny"):
    """`reuse-server serve` on the tiny checkpoint in a subprocess; yields its base URL once /health answers.
    On the way out: stops it and fails if its log holds a traceback."""
    port = free_port()
    cmd = [sys.executable, "-m", "reuse_server.cli", "serve", "--model", str(model_path),
           "--served-model-name", served_name, "--port", str(port), "--log-level", "warning", *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not come up in 120 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of one /metrics scrape."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_idle(url: str, timeout: float = 15.0) -> dict:
    """Poll /metrics until no request runs or waits and no KV block is in use (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = (metric(m, "kvreuse_kv_blocks", state="in_use") == 0 and metric(m, "kvreuse_requests_running") == 0
                and metric(m, "kvreuse_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
