"""A real `reuse-server serve` in a subprocess on a free loopback port, and readers of its /metrics."""
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reuse_server.server.launcher import ServerStartError, served, with_small_pool

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def running_server(model_path, log_path: Path, *extra_args: str, served_name: str = "tiny"):
    """`reuse-server serve` on the tiny checkpoint in a subprocess; yields its base URL once /health answers.
    On the way out: stops it and fails if its log holds a traceback. A test that names no pool size gets a
    small one (with_small_pool), not a share of the machine."""
    args = with_small_pool(["--model", str(model_path), "--served-model-name", served_name, *extra_args])
    try:
        with served(args, log_path, cwd=REPO) as (url, _):
            yield url
    except ServerStartError as exc:
        pytest.fail(str(exc))
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 240.0) -> str:
    """What a command (its stdout a text pipe) printed up to the line holding `marker`, e.g. `reuse-server
    cluster`'s "ready"; fails if it exits first or takes longer than `timeout`."""
    text = ""
    deadline = time.monotonic() + timeout
    while marker not in text:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the command exited with {proc.poll()} before {marker!r}:\n{text}")
        text += line
        assert time.monotonic() < deadline, text
    return text


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of one /metrics scrape."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests_finished(url: str) -> float:
    """Requests the server finished, whatever their finish reason (the random model may stop on its first
    token)."""
    return sum(value for (name, _), value in scrape(url).items() if name == "kvreuse_requests_total")


def wait_idle(url: str, timeout: float = 60.0) -> dict:
    """Poll /metrics until no request runs or waits and no KV block is in use (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = (metric(m, "kvreuse_kv_blocks", state="in_use") == 0 and metric(m, "kvreuse_requests_running") == 0
                and metric(m, "kvreuse_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
