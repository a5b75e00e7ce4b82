"""A hung engine over HTTP (a real server around a real engine whose step is made to block): the watchdog
notices no progress for --step-timeout seconds with work queued; /health answers 503 (`stalled`, with the
reason and Retry-After), new requests get a 503 JSON error with Retry-After, requests in flight end with an
error (a stream with an error event the client reads, then [DONE]), so a gateway routes around the replica.
When the step returns after all, the server serves again and no KV block is left held."""
import json
import threading
import time

import httpx
import pytest

from fault_injection import launch_hanging
from inprocess_server import serving
from reuse_server.engine.config import EngineConfig

pytestmark = pytest.mark.server  # starts a server

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
STEP_TIMEOUT = 2.0
SAFETY = 60  # seconds: a deadline for a slow machine, never what the test measures


def _stalled_error(r: httpx.Response) -> dict:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/json") and int(r.headers["retry-after"]) > 0
    error = r.json()["error"]
    assert error["code"] == "engine_stalled" and error["type"] == "server_error"
    assert "no progress" in error["message"]
    return error


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + SAFETY
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


@pytest.fixture
def hanging_engine(tiny_llama_path):
    engine, switches = launch_hanging(EngineConfig(model=str(tiny_llama_path), served_model_name=MODEL,
                                                   block_size=4, num_gpu_blocks=2048), STEP_TIMEOUT)
    yield engine, switches
    switches.release.set()  # whatever the test did, the engine thread may end


def test_a_hung_engine_answers_503_everywhere_and_serves_again_once_its_step_returns(hanging_engine):
    engine, switches = hanging_engine
    with serving(engine) as url:
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        in_flight = {}

        def wait_for_a_whole_answer():
            in_flight["response"] = httpx.post(url + "/v1/completions", json=LONG, timeout=SAFETY)

        waiter = threading.Thread(target=wait_for_a_whole_answer)
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=SAFETY) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is generating
            waiter.start()
            _wait_for(lambda: engine.snapshot()["running"] == 2, "both requests running")
            switches.hang.set()
            assert switches.hung.wait(SAFETY)
            hung_at = time.monotonic()
            rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        noticed = time.monotonic() - hung_at
        print(f"the stream ended {noticed:.1f} s after the step hung (--step-timeout {STEP_TIMEOUT})")
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_stalled" and "no progress" in error["message"]
        waiter.join(SAFETY)
        _stalled_error(in_flight["response"])

        health = httpx.get(url + "/health")
        assert health.status_code == 503 and int(health.headers["retry-after"]) > 0
        assert health.json()["status"] == "stalled" and "no progress" in health.json()["reason"]
        for path, body in [("/v1/completions", {"model": MODEL, "prompt": "hi"}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/cache/chunks", {"chunks": ["a document"]})]:
            _stalled_error(httpx.post(url + path, json=body, timeout=SAFETY))
        assert switches.hung.is_set() and not switches.release.is_set()  # all of it while the step hung

        switches.release.set()  # the step returns after all: its KV is whole, so the engine serves again
        _wait_for(lambda: httpx.get(url + "/health").status_code == 200, "/health ok again")
        again = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 3}, timeout=SAFETY)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        _wait_for(lambda: engine.snapshot()["in_use_blocks"] == 0 and engine.snapshot()["running"] == 0,
                  "the failed requests' blocks freed")
        assert engine.watchdog.stalls == 1


def test_an_engine_that_is_idle_or_busy_but_stepping_is_never_called_stalled(hanging_engine):
    """Idle for longer than the timeout, then a request of many short steps: no stall."""
    engine, switches = hanging_engine
    with serving(engine) as url:
        time.sleep(STEP_TIMEOUT * 2)  # idle: nothing queued, so no progress is needed
        r = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 200}, timeout=SAFETY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
        assert httpx.get(url + "/health").status_code == 200
        assert engine.watchdog.stalls == 0
