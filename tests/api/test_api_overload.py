"""Overload and failure over HTTP: a full waiting queue answers 429 with Retry-After (counting every choice of
n) and touches no KV block; --request-timeout aborts a request (408, or an error event in a stream) and frees
its blocks; the event loop keeps answering while a huge prompt is tokenized; a dead engine turns /health and
new requests into 503s with the reason, and the stream in flight ends with an error event instead of hanging."""
import json
import threading
import time

import httpx
import openai
import pytest

from fault_injection import FAULT, launch_faulty
from inprocess_server import serving
from reuse_server.engine.config import EngineConfig
from server_process import metric, running_server, scrape, wait_idle

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
# ~3 s of the tiny model here (3,000 tokens were 2.3-2.9 s): the timeout tests need it well past --request-timeout
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}


def _error(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(scope="module")
def queue_server(tiny_llama_path, tmp_path_factory):
    """One sequence runs at a time and two requests may wait."""
    log_path = tmp_path_factory.mktemp("overload") / "server.log"
    with running_server(tiny_llama_path, log_path, "--block-size", "4", "--num-gpu-blocks", "2048",
                        "--max-num-seqs", "1", "--max-waiting", "2") as url:
        yield url


@pytest.fixture(scope="module")
def timeout_server(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("timeout") / "server.log"
    with running_server(tiny_llama_path, log_path, "--block-size", "4", "--num-gpu-blocks", "2048",
                        "--request-timeout", "1") as url:
        yield url


def _open_stream(http: httpx.Client, url: str, **body):
    """Start a streaming completion; returns (response, its line iterator) once the 200 came (it is queued)."""
    request = http.build_request("POST", url + "/v1/completions", json={**LONG, **body, "stream": True})
    response = http.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return response, response.iter_lines()


def test_a_full_queue_answers_429_and_touches_nothing(queue_server):
    wait_idle(queue_server)
    with httpx.Client(timeout=30) as http:
        running, lines = _open_stream(http, queue_server)
        next(line for line in lines if line.startswith("data: "))  # it runs: nobody waits yet
        waiting = [_open_stream(http, queue_server)]
        r = http.post(queue_server + "/v1/completions", json={**LONG, "n": 2})  # one waits; 1 + 2 > 2
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        error = _error(r)
        assert error["code"] == "queue_full" and "2" in error["message"]
        waiting.append(_open_stream(http, queue_server))  # n=1 still fits
        before = scrape(queue_server)
        assert metric(before, "kvreuse_requests_waiting") == 2
        client = openai.OpenAI(base_url=queue_server + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        after = scrape(queue_server)
        for name in ("kvreuse_requests_waiting", "kvreuse_prompt_tokens_total", "kvreuse_requests_running"):
            assert metric(after, name) == metric(before, name), name
        for response, _ in [(running, lines), *waiting]:
            response.close()
    idle = wait_idle(queue_server)
    assert metric(idle, "kvreuse_kv_blocks", state="in_use") == 0
    short = httpx.post(queue_server + "/v1/completions", json={**LONG, "max_tokens": 2, "n": 3}, timeout=30)
    assert short.status_code == 200  # bigger than the queue, into an empty one


def test_a_request_past_its_timeout_is_aborted_with_408(timeout_server):
    before = wait_idle(timeout_server)
    started = time.monotonic()
    r = httpx.post(timeout_server + "/v1/completions", json=LONG, timeout=30)
    assert r.status_code == 408 and 1.0 <= time.monotonic() - started < 10
    assert _error(r)["code"] == "request_timeout"
    after = wait_idle(timeout_server)
    assert metric(after, "kvreuse_kv_blocks", state="in_use") == 0
    aborted = metric(after, "kvreuse_requests_total", finish_reason="abort")
    assert aborted - metric(before, "kvreuse_requests_total", finish_reason="abort") == 1
    generated = metric(after, "kvreuse_generation_tokens_total") - metric(before, "kvreuse_generation_tokens_total")
    assert generated < LONG["max_tokens"]


def test_a_stream_past_its_timeout_ends_with_an_error_event(timeout_server):
    wait_idle(timeout_server)
    with httpx.stream("POST", timeout_server + "/v1/completions", json={**LONG, "stream": True, "n": 2},
                      timeout=30) as r:
        assert r.status_code == 200
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert any("choices" in json.loads(f) for f in frames[:-2])  # it was generating when the timeout struck
    assert metric(wait_idle(timeout_server), "kvreuse_kv_blocks", state="in_use") == 0


def test_the_event_loop_answers_while_a_huge_prompt_is_tokenized(queue_server):
    """Tokenizing a ~2 MB prompt takes seconds; /health keeps answering meanwhile (it would wait for the whole
    encoding if the handler tokenized on the event loop)."""
    wait_idle(queue_server)
    huge = "The quick brown fox jumps over the lazy dog, said the capital of France. " * 30000
    span = {}

    def send_huge():
        span["start"] = time.monotonic()
        span["response"] = httpx.post(queue_server + "/v1/completions", json={"model": MODEL, "prompt": huge},
                                      timeout=120)
        span["end"] = time.monotonic()

    sender = threading.Thread(target=send_huge)
    sender.start()
    answered = []  # (sent, latency) of each /health
    with httpx.Client(timeout=30) as http:
        while sender.is_alive():
            sent = time.monotonic()
            assert http.get(queue_server + "/health").status_code == 200
            answered.append((sent, time.monotonic() - sent))
            time.sleep(0.02)
    sender.join()
    assert span["response"].status_code == 400  # far too long, found out once tokenized
    during = [latency for sent, latency in answered if span["start"] + 0.2 < sent and sent + latency < span["end"]]
    print(f"huge prompt answered in {span['end'] - span['start']:.2f} s; {len(during)} health checks meanwhile, "
          f"slowest {max(during, default=0) * 1000:.0f} ms")
    assert span["end"] - span["start"] > 0.5  # long enough for the comparison to mean something
    # Answered while the prompt was still being tokenized: had the event loop tokenized it, every check sent
    # meanwhile would have been answered only after the prompt's answer. How fast they were is the machine's.
    assert len(during) >= 5


@pytest.fixture
def faulty_engine(tiny_llama_path):
    return launch_faulty(EngineConfig(model=str(tiny_llama_path), served_model_name=MODEL, block_size=4,
                                      num_gpu_blocks=2048))


def test_a_dead_engine_is_visible_and_nothing_hangs(faulty_engine):
    engine, fault = faulty_engine
    with serving(engine) as url:
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            fault.set()
            rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and FAULT in json.loads(rest[-2])["error"]["message"]

        health = httpx.get(url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "dead" and FAULT in health.json()["reason"]
        for path, body in [("/v1/completions", {"model": MODEL, "prompt": "hi"}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/cache/chunks", {"chunks": ["a document"]})]:
            r = httpx.post(url + path, json=body, timeout=10)
            assert r.status_code == 503, (path, r.text)
            error = _error(r)
            assert error["type"] == "server_error" and FAULT in error["message"]
