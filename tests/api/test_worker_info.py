"""What the SGLang model gateway asks of a worker (GET /server_info, /model_info, /get_load), answered from the
engine's real state by a real server on the tiny checkpoint."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_process import running_server

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
BLOCKS = 1040  # room for a 4,000-token decode: seconds of the tiny model, never over before the test hangs up


def wait_for(url: str, ok, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(url + "/get_load").json()
        if ok(load[0]) or time.monotonic() > deadline:
            return load
        time.sleep(0.01)


def stream(url: str, prompt: str, max_tokens: int, done: list, stop: threading.Event | None = None) -> None:
    """Read a streamed completion to its end, or hang up once `stop` is set."""
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                            "ignore_eos": True}) as r:
        for _ in r.iter_lines():
            if stop is not None and stop.is_set():
                break
    done.append(r.status_code)


@pytest.fixture(scope="module")
def url(tiny_llama_path, tmp_path_factory):
    # one sequence at a time: a second request waits while the first decodes
    with running_server(tiny_llama_path, tmp_path_factory.mktemp("worker-info") / "s.log", "--block-size", str(BS),
                        "--num-gpu-blocks", str(BLOCKS), "--max-num-seqs", "1", "--max-num-batched-tokens", "64",
                        "--no-blend-key-shift", "--admin-api-key", "admin") as url:
        yield url


def test_server_and_model_info_describe_the_served_model_and_its_limits(url, tiny_llama_path):
    info = httpx.get(url + "/server_info").json()  # open, like /health, though /metrics has a key
    assert info["served_model_name"] == "tiny" and info["model_path"] == str(tiny_llama_path)
    assert info["max_total_tokens"] == BS * BLOCKS and info["block_size"] == BS
    assert info["max_running_requests"] == 1 and info["max_prefill_tokens"] == 64 and info["dp_size"] == 1
    model = httpx.get(url + "/model_info").json()
    assert model["model_type"] == "llama" and model["served_model_name"] == "tiny" and model["is_generation"]
    assert httpx.get(url + "/metrics").status_code == 401


def test_load_counts_running_and_waiting_requests_and_their_tokens(url):
    idle = httpx.get(url + "/get_load").json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
                     "kv_blocks_in_use": 0, "kv_blocks_total": BLOCKS}]
    done: list = []
    hang_up = threading.Event()
    # the first request could decode nearly the whole pool; it runs until this test hangs up on it, so the
    # second one waits however slowly a busy machine runs either thread
    first = threading.Thread(target=stream, args=(url, "the quick brown fox " * 6, 4000, done, hang_up))
    first.start()
    busy = wait_for(url, lambda load: load["num_reqs"] == 1 and load["kv_blocks_in_use"] > 0)[0]
    assert busy["num_waiting_reqs"] == 0 and busy["num_tokens"] == busy["kv_blocks_in_use"] * BS
    waiting_prompt = "a paged KV cache stores keys " * 5
    second = threading.Thread(target=stream, args=(url, waiting_prompt, 2, done))
    second.start()
    both = wait_for(url, lambda load: load["num_waiting_reqs"] == 1)[0]
    assert both["num_reqs"] == 2 and both["num_waiting_reqs"] == 1
    hang_up.set()
    first.join(120)
    second.join(120)
    assert done == [200, 200]
    prompt_tokens = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": waiting_prompt,
                                                              "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    # the waiting request's prompt is counted on top of the KV the running one holds
    assert both["num_tokens"] >= both["kv_blocks_in_use"] * BS + prompt_tokens
    # the request hung up on frees its blocks; nothing is left counted
    assert wait_for(url, lambda load: load["num_reqs"] == 0)[0]["num_tokens"] == 0
