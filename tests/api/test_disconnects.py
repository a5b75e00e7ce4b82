"""A client that leaves frees what its request held, and the request is counted as aborted: streamed (the
next write fails) and not streamed (the handler polls the connection). The real server in a subprocess on the
tiny random checkpoint.

The requests ask for 4,000 tokens (~3 s of the tiny model here) so that each is still generating when its
client leaves: 900 tokens took ~0.6 s, which a 0.5 s client timeout and the 0.2 s disconnect poll raced."""
import json
import socket
import time
import uuid

import httpx
import pytest

from server_process import metric, running_server, scrape, wait_idle

pytestmark = pytest.mark.server

MODEL = "tiny"
MAX_TOKENS = 4000
MAX_MODEL_LEN = 4096  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    blocks = 2 * MAX_MODEL_LEN // 4 + 64  # two choices of a full-length sequence, 4-token blocks
    with running_server(tiny_llama_path, log_path, "--block-size", "4", "--num-gpu-blocks", str(blocks),
                        "--max-model-len", str(MAX_MODEL_LEN)) as url:
        yield url


def unique_prompt() -> str:
    return f"[{uuid.uuid4().hex[:8]}] The quick brown fox jumps over the lazy dog."


def aborted(samples: dict) -> float:
    return metric(samples, "kvreuse_requests_total", finish_reason="abort")


def generated(samples: dict) -> float:
    return metric(samples, "kvreuse_generation_tokens_total")


def assert_freed_and_aborted(server: str, before: dict, requests: int) -> None:
    after = wait_idle(server)
    assert metric(after, "kvreuse_kv_blocks", state="in_use") == 0 and metric(after, "kvreuse_requests_running") == 0
    assert aborted(after) - aborted(before) == requests
    assert generated(after) - generated(before) < requests * MAX_TOKENS


def test_stream_disconnect_aborts_request(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": unique_prompt(), "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # one iterator, kept alive: closing it would already close the connection
            data = [line for line in (next(lines) for _ in range(3)) if line.startswith("data: ")]
            assert len(data) == 2 and json.loads(data[1][len("data: "):])["choices"][0]["finish_reason"] is None
            during = scrape(server)
            assert metric(during, "kvreuse_requests_running") == 1
            assert metric(during, "kvreuse_kv_blocks", state="in_use") > 0
    # leaving the block closes the connection mid-stream
    assert_freed_and_aborted(server, before, 1)


def test_stream_disconnect_aborts_every_choice(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": unique_prompt(), "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "n": 2}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = set()
            while seen != {0, 1}:  # both choices are generating
                line = next(lines)
                if line.startswith("data: "):
                    seen.update(c["index"] for c in json.loads(line[len("data: "):])["choices"])
            assert metric(scrape(server), "kvreuse_requests_running") == 2
    assert_freed_and_aborted(server, before, 2)


def test_non_stream_disconnect_aborts_request(server):
    """The request goes out on a bare socket, which is closed once /metrics shows it generating: a client
    timeout instead could fire before a busy server had even admitted the request."""
    before = wait_idle(server)
    body = json.dumps({"model": MODEL, "prompt": unique_prompt(), "max_tokens": MAX_TOKENS, "ignore_eos": True})
    url = httpx.URL(server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head.encode() + body.encode())
        deadline = time.monotonic() + 60
        while True:
            during = scrape(server)
            if metric(during, "kvreuse_requests_running") == 1 and generated(during) > generated(before):
                break
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.02)
    assert_freed_and_aborted(server, before, 1)
