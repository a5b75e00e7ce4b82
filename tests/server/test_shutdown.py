"""SIGTERM on a real server with a stream in flight: it keeps listening but refuses new requests with 503 and
Retry-After (and /health says "draining"), lets the stream finish within --shutdown-timeout or ends it with an
error event when the time is up, and exits 0 within the deadline."""
import json
import signal
import time

import httpx
import pytest

from reuse_server.server.launcher import ServerStartError, served
from server_process import REPO

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"


def _stream_then_sigterm(url: str, proc, max_tokens: int) -> tuple[list[dict], float]:
    """Start a stream, SIGTERM the server once it generates, check it refuses new work while draining; return
    the stream's remaining events and the seconds from the signal to the process's exit."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)  # the server notices within a tick (0.1 s)
        with httpx.Client(timeout=10) as other:
            health = other.get(url + "/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = other.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["code"] == "server_shutting_down"
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    proc.wait(timeout=60)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]], time.monotonic() - signalled


@pytest.mark.parametrize("shutdown_timeout, max_tokens, finishes", [(30, 1500, True), (1, 4000, False)],
                         ids=["stream-finishes", "stream-aborted-at-deadline"])
def test_sigterm_drains_then_exits_0(tiny_llama_path, tmp_path, shutdown_timeout, max_tokens, finishes):
    log = tmp_path / "server.log"
    args = ["--model", str(tiny_llama_path), "--served-model-name", MODEL, "--block-size", "4",
            "--num-gpu-blocks", "2048", "--shutdown-timeout", str(shutdown_timeout)]
    try:
        with served(args, log, cwd=REPO) as (url, proc):
            events, took = _stream_then_sigterm(url, proc, max_tokens)
            assert proc.returncode == 0, log.read_text()[-3000:]
    except ServerStartError as exc:
        pytest.fail(str(exc))
    print(f"exit {took:.2f} s after SIGTERM")
    if finishes:
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert took < 20
    else:
        assert events[-1]["error"]["code"] == "server_shutting_down"
        assert took < shutdown_timeout + 10  # the deadline, uvicorn's grace for the last writes, interpreter exit
    text = log.read_text()
    assert "Traceback" not in text and "drained in" in text
