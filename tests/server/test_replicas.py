"""Replicas behind the real SGLang model gateway (sglang-router), sharing KV through a real Redis: the gateway
registers them with their model and load, a conversation whose turns land on different replicas still finds
its earlier turns cached, a replica killed mid-run loses no request the gateway can retry, and loadgen reports
per-replica figures by scraping each replica. Tiny checkpoint; official openai client."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from redis_server import redis_server
from reuse_server.server.cluster import gateway, replica_set
from server_process import REPO, metric, scrape
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 16  # a Redis fetch per block must stay cheaper than recomputing it, even on the tiny model (tiers/costs.py)


def serve_args(model_path) -> list[str]:
    return ["--model", str(model_path), "--served-model-name", "tiny", "--block-size", str(BS),
            "--num-gpu-blocks", "256", "--no-blend-key-shift",
            # these tests are about what Redis holds, not whether it is measured cheaper than recomputing on a
            # busy machine (tiers/costs.py)
            "--tier-fetch", "always"]


@pytest.fixture(scope="module")
def small_llama_path(tmp_path_factory):
    """Wider and deeper than the tiny checkpoint, so that recomputing a block clearly costs more than fetching
    it from Redis: a replica fetches a block only where that is measured cheaper (tiers/costs.py), and on the
    tiny model the two are close enough for a busy machine to tip the choice."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("small-llama"), arch="llama", num_layers=4,
                                 hidden_size=256, intermediate_size=1024)


@pytest.fixture
def redis_url():
    with redis_server() as redis:
        yield redis.url


@pytest.fixture(scope="module")
def round_robin(small_llama_path, tmp_path_factory):
    """(gateway URL, replicas): two replicas sharing one Redis behind a round-robin gateway."""
    logs = tmp_path_factory.mktemp("round-robin")
    with redis_server() as redis, replica_set(2, serve_args(small_llama_path), logs, redis.url) as replicas, \
            gateway([r.url for r in replicas], "round_robin", logs) as (url, _):
        yield url, replicas


def declined(replicas) -> list[float]:
    return [metric(scrape(r.url), "kvreuse_tier_declined_total", tier="redis") for r in replicas]


def requests_served(url: str) -> float:
    return sum(v for (name, _), v in scrape(url).items() if name == "kvreuse_requests_total")


def test_a_conversation_moving_between_replicas_keeps_its_earlier_turns_cached(round_robin):
    url, replicas = round_robin
    before = [requests_served(rep.url) for rep in replicas]
    workers = httpx.get(url + "/workers").json()["workers"]
    assert len(workers) == 2 and all(w["is_healthy"] and w["model_id"] == "tiny" for w in workers)
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    previous = None
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question {turn}: what is the capital of France? "
                                                    "Tell me about the quick brown fox and the lazy dog."})
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        details = r.usage.prompt_tokens_details.model_dump()
        if previous is not None:
            # round robin over two: every turn lands on the other replica, which finds the conversation so
            # far in Redis (at least every full block of the previous prompt, which is this one's prefix)
            assert details["cached_tokens"] >= previous // BS * BS, (turn, details, previous, declined(replicas))
            assert details["tier_tokens"]["redis"] > 0, (turn, details)
        previous = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert [requests_served(rep.url) - b for rep, b in zip(replicas, before)] in ([3, 2], [2, 3])
    loads = httpx.get(url + "/get_loads").json()["workers"]
    assert sorted(w["load"] for w in loads) == [0, 0]  # the gateway reads our /get_load (-1 if it failed)


def test_loadgen_reports_each_replica_behind_the_gateway(round_robin, tmp_path):
    url, replicas = round_robin
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "loadgen.cli", "run", "--server", url, "--workload", "multi-turn", "--requests",
         "8", "--turns", "4", "--concurrency", "1", "--output-tokens", "4", "--max-prompt-tokens", "400",
         "--warmup", "0", "--no-plots", "--no-progress", "--out", str(out), "--replica-metrics",
         *[r.url for r in replicas]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    w = json.loads((out / "report.json").read_text())["workloads"]["multi-turn"]
    per = w["replicas"]["per_replica"]
    assert [p["url"] for p in per] == [r.url for r in replicas]
    assert [p["requests"] for p in per] == [4, 4]  # round robin
    assert sum(p["prompt_tokens"] for p in per) == w["prompt_tokens"]
    assert all(p["prefix_hit_rate"] is not None and p["ttft_mean_ms"] > 0 for p in per)
    # one session at a time: each turn lands on the other replica and finds the earlier ones in Redis
    assert sum(p["redis_hit_blocks"] for p in per) > 0, declined(replicas)
    spread = w["replicas"]["spread"]
    assert spread["requests"] == [4, 4] and spread["max_request_share"] == 0.5 and spread["requests_cv"] == 0
    assert "## Replicas" in (out / "report.md").read_text()
    assert "requests per replica 4 / 4" in done.stdout


def test_a_replica_killed_mid_run_loses_no_request_the_gateway_can_retry(tiny_llama_path, tmp_path, redis_url):
    with replica_set(2, serve_args(tiny_llama_path), tmp_path, redis_url) as replicas, \
            gateway([r.url for r in replicas], "power_of_two", tmp_path) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int):
            return client.chat.completions.create(
                model="tiny", max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Request {i}: the quick brown fox jumps over the lazy dog."}])

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, i) for i in range(32)]
            # the victim is whichever replica the gateway has given work first (a counter: it cannot be missed
            # between two polls), never a given one: on a busy machine one replica can take them all
            deadline = time.monotonic() + 60
            while not (busy := [rep for rep in replicas if requests_served(rep.url) >= 2]):
                assert time.monotonic() < deadline, "no replica served 2 requests"
                time.sleep(0.02)
            victim, survivor = busy[0], next(rep for rep in replicas if rep is not busy[0])
            unanswered_at_kill = sum(not f.done() for f in futures)
            victim.process.kill()  # mid-run: requests are in flight on it and more are coming
            answers = [f.result() for f in futures]
        # What happened, whatever the machine's speed: the kill came with requests still unanswered, and every
        # one of the 32 got its whole answer (those the dead replica held were retried on the survivor).
        assert unanswered_at_kill > 0
        assert all(a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 24 for a in answers)
        workers = {w["url"]: w for w in httpx.get(url + "/workers").json()["workers"]}
        assert workers[survivor.url]["is_healthy"]
        # and the survivor goes on serving
        assert ask(99).usage.completion_tokens == 24


def test_a_stream_cut_by_a_replica_kill_ends_in_an_error_the_client_sees_and_retried_requests_succeed(
        tiny_llama_path, tmp_path, redis_url):
    """Three replicas, round robin: one stream on each; one replica is SIGKILLed. Its stream ends with an error
    the openai client raises (the gateway cuts the response mid-body: never a stream that looks complete), the
    other two run to their end; new requests all succeed (the gateway retries those sent to the dead one) and
    the gateway takes the dead replica out of its rotation by its health checks."""
    with replica_set(3, serve_args(tiny_llama_path), tmp_path, redis_url) as replicas, \
            gateway([r.url for r in replicas], "round_robin", tmp_path) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        streams = [client.completions.create(model="tiny", prompt=f"Story {i}: once upon a time", max_tokens=3000,
                                             stream=True, extra_body={"ignore_eos": True}) for i in range(3)]
        chunks = [iter(s) for s in streams]
        for it in chunks:
            next(it)  # each is streaming
        assert [metric(scrape(r.url), "kvreuse_requests_running") for r in replicas] == [1, 1, 1]
        victim = replicas[1]
        victim.process.kill()
        victim.process.wait()

        # Each stream is read to its end: the dead replica's may still deliver what it had sent before the kill
        # (on a busy machine hundreds of chunks sit in the gateway's and the socket's buffers), then it must
        # raise; the survivors' end cleanly at max_tokens.
        outcomes = []  # per stream: the error it raised, or the finish reason it ended with
        for s, it in zip(streams, chunks):
            try:
                finish = None
                for chunk in it:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                outcomes.append(finish)
            except Exception as exc:  # what a client sees of the cut
                outcomes.append(exc)
            finally:
                s.close()
        errors = [o for o in outcomes if isinstance(o, Exception)]
        print("after the kill:", [type(o).__name__ if isinstance(o, Exception) else o for o in outcomes])
        assert len(errors) == 1 and all(o == "length" for o in outcomes if not isinstance(o, Exception))
        assert isinstance(errors[0], (httpx.TransportError, openai.APIError)), repr(errors[0])

        def ask(i: int):
            return client.chat.completions.create(
                model="tiny", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Request {i} after the kill."}])

        answers = [ask(i) for i in range(6)]  # round robin sends some to the dead one: retried elsewhere
        assert all(a.usage.completion_tokens == 8 for a in answers)
        deadline = time.monotonic() + 120  # a safety net: the health checks take a few seconds
        while True:
            workers = {w["url"]: w for w in httpx.get(url + "/workers").json()["workers"]}
            if victim.url not in workers or not workers[victim.url]["is_healthy"]:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.2)
        assert all(workers[r.url]["is_healthy"] for r in replicas if r is not victim)


def test_conversations_outlive_a_replica_killed_between_turns(small_llama_path, tmp_path, redis_url):
    """Two replicas sharing Redis, round robin; six conversations of six turns, one replica SIGKILLed after the
    third turn: no request fails afterwards (the gateway retries those sent to the dead one), and each later
    turn on the survivor still finds the whole earlier conversation cached (Redis holds what the dead one
    computed: a replica answers only once its blocks are written)."""
    with replica_set(2, serve_args(small_llama_path), tmp_path, redis_url) as replicas, \
            gateway([r.url for r in replicas], "round_robin", tmp_path) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        conversations = [[{"role": "system", "content": f"You are assistant number {c}."}] for c in range(6)]
        previous = [None] * 6
        prompt_after = cached_after = 0
        for turn in range(6):
            if turn == 3:
                replicas[1].process.kill()
                replicas[1].process.wait()
            for c, messages in enumerate(conversations):
                messages.append({"role": "user", "content": f"Conversation {c}, question {turn}: tell me about the "
                                                            "quick brown fox and the lazy dog, at some length."})
                r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0.0,
                                                   extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 8
                cached = r.usage.prompt_tokens_details.cached_tokens
                if previous[c] is not None:
                    assert cached >= previous[c] // BS * BS, (turn, c, cached, previous[c], declined(replicas[:1]))
                if turn >= 3:
                    prompt_after += r.usage.prompt_tokens
                    cached_after += cached
                previous[c] = r.usage.prompt_tokens
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
        print(f"after the kill: {cached_after / prompt_after:.1%} of the prompt tokens cached on the survivor")
