"""Behind vllm-router 0.1.17 (`--policy kv_aware`), the real router on loopback in front of two replicas that
publish their KV events: a prompt a replica already holds, warmed by calling that replica directly (so only
its events can tell the router), goes to that replica; once a replica has evicted a prompt both held, the
prompt goes to the other; a replica SIGKILLed mid-run costs no request (the router retries on the survivor).
Which replica served each request is read from each replica's /metrics.

The router ingests events on its own schedule and shows nothing of its index; after a replica has published
the events of a warm-up the test gives the router a moment (a safety margin, not a measure) before routing."""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from reuse_server.server.cluster import gateway, replica_set
from server_process import metric, requests_finished, scrape

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
SEED = 20261201
WORDS = ("river salt wool grain trader spring market bridge tower harbor winter lantern copper meadow orchard "
         "archive signal engine quarry garden mirror").split()


def text(seed: int, words: int = 15) -> str:
    """About 6 tokens a word with the tiny checkpoint's tokenizer (its context is 256 tokens)."""
    rng = random.Random(SEED + seed)
    print("text seed", SEED + seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@contextmanager
def routed_replicas(model_path, logs):
    """(router URL, its process, the replicas) once the router has subscribed to each replica's events."""
    args = ["--model", str(model_path), "--served-model-name", "tiny", "--block-size", str(BS),
            "--num-gpu-blocks", "64", "--no-blend-key-shift"]
    with replica_set(2, args, logs, kv_events=True) as replicas, \
            gateway([r.url for r in replicas], "kv_aware", logs, router="vllm-router") as (url, proc):
        deadline = time.monotonic() + 60
        while not all(events(r.url)["subscribers"] >= 1 for r in replicas):
            assert time.monotonic() < deadline, "the router did not subscribe to the replicas' events"
            time.sleep(0.1)
        yield url, proc, replicas


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    with routed_replicas(tiny_llama_path, tmp_path_factory.mktemp("kv-routing")) as (url, _, replicas):
        yield url, [r.url for r in replicas]


def events(url: str) -> dict:
    return httpx.get(url + "/server_info").json()["kv_events"]


def complete(url: str, prompt: str, chat: bool = False) -> dict:
    if chat:
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    else:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def render(url: str, prompt: str, chat: bool) -> list[int]:
    if chat:
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}
        return httpx.post(url + "/v1/chat/completions/render", json=body).json()["token_ids"]
    return httpx.post(url + "/v1/completions/render", json={"model": "tiny", "prompt": prompt}).json()[0]["token_ids"]


def shared_blocks(url: str, first: str, second: str, chat: bool) -> int:
    """Tokens of `second` in full blocks that `first` already computed (the last token is always computed)."""
    a, b = render(url, first, chat), render(url, second, chat)
    n = 0
    while n < min(len(a), len(b) - 1) and a[n] == b[n]:
        n += 1
    return n // BS * BS


def warm(url: str, prompt: str, chat: bool = False) -> dict:
    """Run `prompt` on one replica directly; return once its events are out (and the router had a moment)."""
    before = events(url)["published"]
    out = complete(url, prompt, chat)
    deadline = time.monotonic() + 30
    while events(url)["published"] == before:
        assert time.monotonic() < deadline, "the replica published no events"
        time.sleep(0.05)
    time.sleep(0.5)
    return out


def routed(router: str, replicas: list[str], prompt: str, chat: bool = False) -> tuple[int, dict]:
    """Send `prompt` through the router; which replica served it, and the answer."""
    before = [requests_finished(u) for u in replicas]
    out = complete(router, prompt, chat)
    deadline = time.monotonic() + 30  # a replica counts its finished request just after the answer leaves
    while not (grew := [i for i, u in enumerate(replicas) if requests_finished(u) > before[i]]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(grew) == 1, grew
    return grew[0], out


@pytest.mark.parametrize("holder,chat", [(0, False), (1, True), (1, False), (0, True)])
def test_a_prompt_goes_to_the_replica_whose_events_say_it_holds_it(cluster, holder, chat):
    router, replicas = cluster
    prompt = text(10 * holder + chat)
    first = warm(replicas[holder], prompt, chat)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nobody held it before
    second = prompt + " and then the harbor"
    where, out = routed(router, replicas, second, chat)
    assert where == holder
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared_blocks(replicas[0], prompt, second, chat) > 0


@pytest.mark.parametrize("evicting", [0, 1])
def test_a_replicas_evictions_move_the_prompt_to_the_other(cluster, evicting):
    router, replicas = cluster
    prompt = text(100 + evicting)
    for url in replicas:
        warm(url, prompt)
    target = replicas[evicting]
    evicted = metric(scrape(target), "kvreuse_evicted_blocks_total")
    for i in range(3):  # unrelated prompts that need the whole device pool (the prompt is the oldest in it)
        warm(target, text(200 + 10 * evicting + i, words=35))
    assert metric(scrape(target), "kvreuse_evicted_blocks_total") > evicted
    where, out = routed(router, replicas, prompt + " and then the harbor")
    assert where == 1 - evicting
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def router_metric(proc, name: str, **labels) -> float:
    """A sample of the router's own Prometheus metrics (its --prometheus-port, as the gateway helper set it)."""
    port = proc.args[proc.args.index("--prometheus-port") + 1]
    return metric(scrape(f"http://127.0.0.1:{port}"), name, **labels)


def test_a_replica_killed_mid_run_costs_no_request_the_router_can_retry(tiny_llama_path, tmp_path):
    """Two replicas of its own (the kill would take one from the module's). Replica 1 holds two prompts the
    router knows of by its events only; 24 requests run through the router, 6 at a time (the first two continue
    the held prompts, so the router sends those to replica 1 however it spreads the rest), and replica 1 is
    SIGKILLed once it has taken one. Every one of the 24 gets its whole answer (those the dead replica
    dropped are sent again, to the survivor: the router counts the retries), and so do the continuations of
    the two prompts sent after the kill, which the router's index still places on the dead replica; they are
    served by the survivor. The router's health checks then take the dead replica out."""
    with routed_replicas(tiny_llama_path, tmp_path) as (router, proc, reps):
        replicas = [r.url for r in reps]
        held = [text(400 + i) for i in range(2)]
        for prompt in held:
            warm(replicas[1], prompt)

        def ask(i: int) -> dict:
            # the first two continue the prompts replica 1 holds, so the router sends it those (what this module's
            # first test shows) whatever it does with the others: on a busy machine it may send them all to one
            prompt = f"{held[i]} and then request {i}" if i < len(held) else f"Request {i}: {text(300 + i)}"
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
            r = httpx.post(router + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, (i, r.status_code, r.text)
            return r.json()

        deadline = time.monotonic() + 60  # a busy machine can fail a health check; the run needs both replicas
        while not all(w["is_healthy"] for w in httpx.get(router + "/workers").json()["workers"]):
            assert time.monotonic() < deadline, httpx.get(router + "/workers").json()
            time.sleep(0.2)
        admitted_before = metric(scrape(replicas[1]), "kvreuse_prompt_tokens_total")
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(ask, i) for i in range(24)]
            deadline = time.monotonic() + 240
            # the router has sent it one: a counter, since a request of 64 tokens can run between two polls
            while metric(scrape(replicas[1]), "kvreuse_prompt_tokens_total") == admitted_before:
                assert time.monotonic() < deadline and not all(f.done() for f in futures), \
                    "the router sent replica 1 nothing"
                time.sleep(0.02)
            unanswered_at_kill = sum(not f.done() for f in futures)
            reps[1].process.kill()  # mid-run: requests are in flight on it and more are coming
            reps[1].process.wait()
            answers = [f.result() for f in futures]
        assert unanswered_at_kill > 0
        assert all(a["usage"]["completion_tokens"] == 64 for a in answers)
        for prompt in held:  # the router's index still says replica 1 holds it
            where, out = routed(router, replicas[:1], prompt + " and then the harbor")
            assert where == 0 and out["usage"]["completion_tokens"] == 1
        assert router_metric(proc, "vllm_router_retries_total", route="/v1/completions") > 0
        deadline = time.monotonic() + 240  # a safety net: the health checks take a few seconds
        while True:
            workers = {w["url"]: w for w in httpx.get(router + "/workers").json()["workers"]}
            if replicas[1] not in workers or not workers[replicas[1]]["is_healthy"]:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.2)
        assert workers[replicas[0]]["is_healthy"]
        assert routed(router, replicas[:1], "one more after the router dropped it")[0] == 0
