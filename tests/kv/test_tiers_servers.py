"""KV tiers through real servers: two servers sharing one real Redis (what one computed, the other reuses:
prompts and precomputed chunks), a server restarted on its disk folder (after a clean stop and after SIGKILL
in the middle of writes), prefetch, /v1/cache/stats and the tier metrics. Official openai client."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from redis_server import redis_server
from reuse_server.server.launcher import free_port
from server_process import REPO, metric, running_server, scrape, wait_idle

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
SEED = 1130


def args(*extra):
    return ["--block-size", str(BS), "--num-gpu-blocks", "256", "--no-blend-key-shift", *extra]


def text_prompt(seed: int, words: int = 120) -> str:
    rng = random.Random(SEED + seed)
    print("prompt seed", SEED + seed)
    vocab = "alpha beta gamma delta river stone cloud paper seven orange window garden yellow silver".split()
    return " ".join(rng.choice(vocab) for _ in range(words))


def complete(url: str, prompt: str, **extra):
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.0,
                                     extra_body={"ignore_eos": True, **extra})


def details(r) -> dict:
    return r.usage.prompt_tokens_details.model_dump()


def test_a_second_server_reuses_what_the_first_computed_through_redis(tiny_llama_path, tmp_path):
    with redis_server() as redis:
        prompt = text_prompt(1)
        with running_server(tiny_llama_path, tmp_path / "a.log", *args("--redis-url", redis.url)) as a:
            first = complete(a, prompt)
            assert details(first)["cached_tokens"] == 0
            # documents precomputed on A are blended on B
            docs = [text_prompt(10 + i, 60) for i in range(2)]
            assert httpx.post(a + "/v1/cache/chunks", json={"chunks": docs}, timeout=60).status_code == 200
            wait_for_writes(a, "redis")
        with running_server(tiny_llama_path, tmp_path / "b.log", *args("--redis-url", redis.url)) as b:
            second = complete(b, prompt)
            full = (first.usage.prompt_tokens - 1) // BS * BS
            got = details(second)
            assert got["cached_tokens"] == full and got["tier_tokens"]["redis"] == full
            assert second.choices[0].text == first.choices[0].text
            client = OpenAI(base_url=b + "/v1", api_key="unused", max_retries=0)
            blended = client.chat.completions.create(
                model="tiny", max_tokens=4, temperature=0.0,
                messages=[{"role": "user", "content": [{"type": "text", "text": d} for d in docs[::-1]]
                           + [{"type": "text", "text": "Which came first?"}]}],
                extra_body={"kv_blend": {"enabled": True, "recompute_ratio": 0.0}})
            assert blended.usage.prompt_tokens_details.model_dump()["blended_tokens"] > 0
            m = scrape(b)
            assert metric(m, "kvreuse_tier_hits_total", tier="redis") > 0


def wait_for_writes(url: str, tier: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(url), "kvreuse_tier_write_queue_bytes", tier=tier) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_restarted_server_hits_its_disk_and_prefetch_pulls_blocks_up(tiny_llama_path, tmp_path):
    folder = tmp_path / "kv"
    prompt = text_prompt(2)
    with running_server(tiny_llama_path, tmp_path / "a.log", *args("--disk-cache-dir", str(folder))) as a:
        first = complete(a, prompt)
    # stopped cleanly: every block was flushed
    with running_server(tiny_llama_path, tmp_path / "b.log", *args("--disk-cache-dir", str(folder))) as b:
        full = (first.usage.prompt_tokens - 1) // BS * BS
        fetched = httpx.post(b + "/v1/cache/prefetch", json={"prompt": prompt}, timeout=30).json()
        assert fetched["object"] == "cache.prefetch" and fetched["prompt_tokens"] == first.usage.prompt_tokens
        assert fetched["resident_tokens"] == full and fetched["tier_tokens"]["disk"] == full
        again = complete(b, prompt)
        got = details(again)
        assert got["cached_tokens"] == full and got["tier_tokens"]["disk"] == 0  # already resident
        assert again.choices[0].text == first.choices[0].text
        stats = httpx.get(b + "/v1/cache/stats").json()
        assert stats["tiers"]["disk"]["hits"] == full // BS and stats["device"]["cached_blocks"] >= full // BS
        assert stats["device"]["held_tokens"] >= full and stats["device"]["kv_dtype"] == "float32"
        bad = httpx.post(b + "/v1/cache/prefetch", json={"prompt": prompt, "messages": [{"role": "user",
                                                                                         "content": "x"}]})
        assert bad.status_code == 400
        assert metric(wait_idle(b), "kvreuse_kv_blocks", state="in_use") == 0


def test_a_server_killed_in_the_middle_of_writes_leaves_nothing_half_written(tiny_llama_path, tmp_path):
    folder = tmp_path / "kv"
    prompt = text_prompt(3, words=170)
    port = free_port()
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "reuse_server.server.cli", "serve", "--port", str(port), "--model",
                             str(tiny_llama_path), "--served-model-name", "tiny", "--log-level", "warning",
                             *args("--disk-cache-dir", str(folder))], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.2)
        first = complete(url, prompt)
        os.kill(proc.pid, signal.SIGKILL)  # the writer is still storing the blocks (fsync per block)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    # what a kill in the middle of a write leaves behind: a temporary file, never a block file
    sub = next(p for p in folder.rglob("*") if p.is_dir() and len(p.name) == 2)
    (sub / ".tmp-half-written.kv").write_bytes(b"KVRB" + os.urandom(1000))
    with running_server(tiny_llama_path, tmp_path / "b.log", *args("--disk-cache-dir", str(folder))) as b:
        assert not list(folder.rglob(".tmp-*"))  # removed at start-up, never read
        again = complete(b, prompt)
        assert again.choices[0].text == first.choices[0].text
        m = scrape(b)
        assert metric(m, "kvreuse_tier_corrupt_blocks_total", tier="disk") == 0
        assert details(again)["cached_tokens"] == metric(m, "kvreuse_tier_hits_total", tier="disk") * BS
