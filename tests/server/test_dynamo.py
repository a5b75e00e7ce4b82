"""`reuse-server dynamo-worker` behind NVIDIA Dynamo 1.6.1's own frontend (`python -m dynamo.frontend
--router-mode kv`), all on loopback without etcd or NATS (file discovery, TCP request plane, ZMQ event
plane): two of our workers register the tiny checkpoint, the frontend tokenizes and routes, and a prompt that
continues one a worker computed goes to that worker (Dynamo's KV router knows it only from the KV events our
engine publishes and the worker relays) and is served from its cache; once a worker has evicted a prompt both
computed (its BlockRemoved events applied by the router), the prompt goes to the other; a worker SIGKILLed
mid-run costs no request (the frontend migrates them, with --migration-limit). Which worker served a request is
read from each worker's Dynamo metrics (DYN_SYSTEM_PORT), what the router applied from the frontend's.

`make test` installs Dynamo (ai-dynamo-runtime through the dynamo extra, ai-dynamo without its NVIDIA-only
dependencies), so the test runs wherever the suite does."""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from reuse_server.server.dynamo_cluster import dynamo_cluster

import dynamo.llm  # noqa: F401  (installed by make; an ImportError here is a broken set-up, not a skip)
import msgspec  # noqa: F401  (dynamo.frontend needs it)

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
SEED = 20261201
WORDS = "river salt wool grain trader spring market bridge tower harbor winter lantern copper meadow".split()


def text(seed: int, words: int = 15) -> str:
    rng = random.Random(SEED + seed)
    print("text seed", SEED + seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def worker_requests(port: int) -> float:
    text_ = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text_.splitlines():
        if line.startswith("dynamo_component_requests_total{") and 'dynamo_endpoint="generate"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def dynamo(tiny_llama_path, tmp_path_factory):
    serve_args = ["--model", str(tiny_llama_path), "--served-model-name", "tiny", "--block-size", str(BS),
                  "--num-gpu-blocks", "64", "--no-blend-key-shift"]
    with dynamo_cluster(2, serve_args, tmp_path_factory.mktemp("dynamo"), startup_timeout=240) as cluster:
        yield cluster.url, cluster.system_ports
    for log in cluster.worker_logs:
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served_by(ports, before) -> int:
    grew = [i for i, port in enumerate(ports) if worker_requests(port) > before[i]]
    assert len(grew) == 1, grew
    return grew[0]


@pytest.mark.parametrize("k", range(4))
def test_a_continued_prompt_goes_to_the_worker_holding_it(dynamo, k):
    url, ports = dynamo
    prompt = f"{k} {text(k)}"  # apart from the others' from the first block on
    before = [worker_requests(p) for p in ports]
    first = complete(url, prompt)
    holder = served_by(ports, before)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(0.5)  # the events go worker -> Dynamo's relay -> the router on their own schedule (a margin)
    before = [worker_requests(p) for p in ports]
    second = complete(url, prompt + " and then the harbor")
    assert served_by(ports, before) == holder
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= BS


def samples(url: str, name: str, *labels: str) -> float:
    """The sum of `name`'s samples at url/metrics whose labels include each of `labels` (`key="value"`)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith(name + "{") and all(label in line for label in labels))


def worker_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def worker_id(port: int) -> int:
    """The worker's Dynamo instance id (its metrics' worker_id label, in hex), which the frontend routes by."""
    for line in httpx.get(worker_url(port) + "/metrics", timeout=5).text.splitlines():
        if line.startswith("dynamo_component_requests_total{") and 'dynamo_endpoint="generate"' in line:
            return int(line.split('worker_id="', 1)[1].split('"', 1)[0], 16)
    raise AssertionError(f"no worker_id in the metrics of {port}")


def relayed(ports, kind: str) -> float:
    """KV events of `kind` (stored, removed) the workers' Dynamo runtimes took from our engines to relay."""
    return sum(samples(worker_url(p), "dynamo_component_kv_publisher_zmq_events_total", f'event_type="{kind}"',
                       'stage="accepted"') for p in ports)


def applied(url: str, kind: str, *labels: str) -> float:
    """KV events of `kind` the frontend's KV router applied to its index (any outcome unless labels say)."""
    return samples(url, "dynamo_component_kv_cache_events_applied", f'event_type="{kind}"', *labels)


def until(ok, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.1)


def settled(url: str, ports) -> bool:
    """The router has applied every event the workers relayed (>=: a recovery replay may apply one twice)."""
    return all(applied(url, kind) >= relayed(ports, kind) for kind in ("stored", "removed"))


def pinned(url: str, ports, prompt: str, worker: int) -> dict:
    """`prompt` run on one worker, named by instance id (nvext.backend_instance_id): the router's index learns
    of it only from that worker's events."""
    before = [worker_requests(p) for p in ports]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1,
            "nvext": {"backend_instance_id": worker_id(ports[worker])}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert served_by(ports, before) == worker
    return r.json()


@pytest.mark.parametrize("evicting", [0, 1])
def test_a_workers_evictions_move_the_prompt_to_the_other(dynamo, evicting):
    """Both workers compute a prompt (each sent it by instance id); one then computes unrelated prompts that
    need its whole pool (64 blocks), which evicts the prompt, and relays the BlockRemoved events; once the router
    has applied them the continued prompt goes to the other worker and is served from its cache."""
    url, ports = dynamo
    prompt = f"{5 + evicting} {text(100 + evicting)}"
    stored = applied(url, "stored", 'status="ok"')
    for worker in (0, 1):
        assert pinned(url, ports, prompt, worker)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    until(lambda: applied(url, "stored", 'status="ok"') >= stored + 2 and settled(url, ports),
          "the router's taking the workers' stored events")
    removed, relayed_removals = applied(url, "removed", 'status="ok"'), relayed(ports[evicting:evicting + 1], "removed")
    for i in range(3):  # the prompt is the oldest in the pool
        pinned(url, ports, text(200 + 10 * evicting + i, words=35), evicting)
    assert relayed(ports[evicting:evicting + 1], "removed") > relayed_removals  # it evicted and said so
    until(lambda: applied(url, "removed", 'status="ok"') > removed and settled(url, ports),
          "the router's applying the BlockRemoved events")
    before = [worker_requests(p) for p in ports]
    out = complete(url, prompt + " and then the harbor")
    assert served_by(ports, before) == 1 - evicting
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= BS


def test_a_worker_killed_mid_run_costs_no_request_the_frontend_can_retry(tiny_llama_path, tmp_path):
    """Two workers of its own behind a frontend with --migration-limit 3 (by default, 0, Dynamo answers 503 for
    each request a dead worker held or is sent before discovery drops it). Streamed requests ask Dynamo to name
    in their chunks the worker the router sent them to (nvext.extra_fields: worker_id): a long one (1024
    tokens) and 24 short ones beside it, 6 at a time. The worker the long one's first chunk names is SIGKILLed
    at once, by the thread that read it: so the victim is killed generating it (its other 1023 tokens take far
    longer than a chunk's way to the client), while short ones run and more are coming, whichever worker the
    KV router chose (which one gets the short ones depends on load and timing: on a busy machine one worker can
    take them all, so the test never waits for a given one to get some). Every request gets its whole answer:
    the frontend migrates those the dead worker dropped (with what they had generated: the long one goes on
    from the survivor, a migration Dynamo counts as ongoing_request) and those it still routes there to the
    survivor. The dead worker's discovery entry expires (the file backend's lease), the router drops it, and
    what comes after is all served by the survivor."""
    serve_args = ["--model", str(tiny_llama_path), "--served-model-name", "tiny", "--block-size", str(BS),
                  "--num-gpu-blocks", "512", "--no-blend-key-shift"]  # the long request fits beside the others
    with dynamo_cluster(2, serve_args, tmp_path, startup_timeout=240,
                        frontend_args=["--migration-limit", "3"]) as cluster:
        url, ports = cluster.url, cluster.system_ports
        ids = [worker_id(port) for port in ports]  # the workers as the chunks name them
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)  # the frontend retries
        victims: list[int] = []

        def kill(worker: int) -> None:
            cluster.worker_processes[worker].kill()  # mid-run: it is generating the request just read
            victims.append(worker)

        def ask(i: int, max_tokens: int = 64, on_first_chunk=lambda worker: None) -> dict:
            """Request i, streamed; on_first_chunk gets the worker the first chunk names. Its usage."""
            stream = client.completions.create(
                model="tiny", prompt=f"Request {i}: {text(300 + i)}", max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "nvext": {"extra_fields": ["worker_id"]}})
            usage, first = None, True
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
                if chunk.choices and first:
                    first = False
                    on_first_chunk(ids.index(chunk.model_extra["nvext"]["worker_id"]["decode_worker_id"]))
            return usage

        with ThreadPoolExecutor(7) as pool:
            long = pool.submit(ask, 99, 1024, kill)
            futures = [pool.submit(ask, i) for i in range(24)]
            long_usage = long.result()
            answers = [f.result() for f in futures]
        victim, = victims
        survivor = 1 - victim
        cluster.worker_processes[victim].wait()
        assert long_usage["completion_tokens"] == 1024
        assert all(usage["completion_tokens"] == 64 for usage in answers)
        # the frontend took up again at least one stream the victim had started (the long one): Dynamo counts
        # those apart from requests it could not send to the dead worker at all (new_request)
        migrations = {kind: samples(url, "dynamo_frontend_model_migration_total", f'migration_type="{kind}"')
                      for kind in ("ongoing_request", "new_request")}
        print("migrations:", migrations)
        assert migrations["ongoing_request"] >= 1
        until(lambda: samples(url, "dynamo_component_router_worker_registered",
                              f'router_worker_id="{ids[victim]}"') == 0,
              "the router's dropping the dead worker")
        before = worker_requests(ports[survivor])
        after = [client.completions.create(model="tiny", prompt=f"Request {100 + i}: {text(400 + i)}",
                                           max_tokens=64, extra_body={"ignore_eos": True}) for i in range(4)]
        assert all(a.usage.completion_tokens == 64 for a in after)
        assert worker_requests(ports[survivor]) - before == 4


def test_served_names_and_max_tokens_reach_dynamo(tiny_llama_path, tmp_path):
    """One worker with two served names and --max-tokens 3: the frontend serves the model under both names (the
    second registered as Dynamo's alias) and an unknown name is a 404; the worker caps any limit at 3 tokens
    (ignore_eos: the cap, not the model, ends each answer), a smaller one still wins."""
    serve_args = ["--model", str(tiny_llama_path), "--served-model-name", "tiny", "tiny-alias", "--max-tokens", "3",
                  "--block-size", str(BS), "--num-gpu-blocks", "64", "--no-blend-key-shift"]
    with dynamo_cluster(1, serve_args, tmp_path, startup_timeout=240) as cluster:
        def ask(model: str, max_tokens: int) -> httpx.Response:
            return httpx.post(cluster.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": text(400), "max_tokens": max_tokens, "ignore_eos": True})

        for model in ("tiny", "tiny-alias"):
            r = ask(model, 50)
            assert r.status_code == 200, (model, r.text)
            assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
        assert ask("tiny", 2).json()["usage"]["completion_tokens"] == 2
        assert ask("gpt-4", 5).status_code == 404
