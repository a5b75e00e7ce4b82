"""Mixed traffic for a while, then proof that nothing leaked: the soak driver bench_soak.py and
tests/test_soak.py share.

Many concurrent clients over HTTP, each looping over a random mix: completions sharing one of a few long
prefixes, chats with a shared system prompt, RAG chats that blend documents from a small pool (parts in a new
order each time), precomputes of those documents (POST /v1/cache/chunks), long prompts, `n` > 1, streaming
and not. A fraction of the clients leave early: a stream closed after a random number of events (none at all,
sometimes), a non-streaming request given up after a random short wait. Every other response must be a
complete success. Afterwards the server must settle: no request running or waiting, no KV block in use (so no
lock left), free + evictable == total; and a fixed greedy probe must answer exactly as it did before.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("cache block prefix token radix tree engine stream client server request blend chunk document "
         "question answer model layer head query key value paged pool evict lock tenant queue shutdown "
         "harbour road autumn fair committee minutes north river bridge market lamp tower garden").split()
PROBE = "The committee met on a Tuesday to review the harbour accounts and"


def text(rng: random.Random, words: int, tag: str = "") -> str:
    return (tag + " " if tag else "") + " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class SoakResult:
    seed: int
    duration_s: float = 0.0
    requests: int = 0  # sent, including those the client left
    completed: int = 0  # answered in full
    disconnects: int = 0  # the client left on purpose
    kinds: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # anything else: wrong status, error event, missing [DONE]

    def summary(self) -> dict:
        return dict(seed=self.seed, duration_s=round(self.duration_s, 1), requests=self.requests,
                    completed=self.completed, disconnects=self.disconnects, errors=len(self.errors),
                    kinds=dict(self.kinds), statuses={str(k): v for k, v in sorted(self.statuses.items())})


class Traffic:
    """One random request at a time, from fixed pools of prefixes and documents (so requests share them)."""

    def __init__(self, model: str, seed: int, max_prompt_words: int = 300) -> None:
        pools = random.Random(seed)
        self.model = model
        self.prefixes = [text(pools, pools.randrange(40, 160), f"[prefix {i}]") for i in range(3)]
        self.system = text(pools, 60, "[system]")
        self.docs = [text(pools, pools.randrange(20, 60), f"[doc {i}]") for i in range(6)]
        self.max_prompt_words = max_prompt_words

    def request(self, rng: random.Random) -> tuple[str, str, dict]:
        """(kind, path, body) of a random request."""
        kind = rng.choices(["prefix", "chat", "blend", "precompute", "long"], weights=[4, 3, 3, 1, 1])[0]
        common = dict(model=self.model, max_tokens=rng.randrange(1, 40), n=rng.choice([1, 1, 1, 2, 3]),
                      temperature=rng.choice([0.0, 0.8]), stream=rng.random() < 0.7,
                      ignore_eos=rng.random() < 0.5)
        if kind == "prefix":
            return kind, "/v1/completions", {**common, "prompt": rng.choice(self.prefixes) + text(rng, rng.randrange(1, 30))}
        if kind == "long":
            words = rng.randrange(self.max_prompt_words // 2, self.max_prompt_words)
            return kind, "/v1/completions", {**common, "prompt": text(rng, words)}
        if kind == "chat":
            messages = [{"role": "system", "content": self.system},
                        {"role": "user", "content": text(rng, rng.randrange(3, 40))}]
            return kind, "/v1/chat/completions", {**common, "messages": messages}
        docs = rng.sample(self.docs, rng.randrange(1, 4))
        if kind == "precompute":
            return kind, "/v1/cache/chunks", {"model": self.model, "chunks": docs}
        parts = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": "Question: " + text(rng, 6)}]
        return kind, "/v1/chat/completions", {
            **common, "messages": [{"role": "user", "content": parts}],
            "kv_blend": {"enabled": True, "recompute_ratio": rng.choice([0.0, 0.15, 0.5])}}


async def one_request(http: httpx.AsyncClient, url: str, rng: random.Random, traffic: Traffic,
                      result: SoakResult, leave_rate: float) -> None:
    kind, path, body = traffic.request(rng)
    result.requests += 1
    result.kinds[kind] += 1
    leave = rng.random() < leave_rate
    label = f"{kind} {path} n={body.get('n')} stream={body.get('stream')}"
    if body.get("stream"):
        async with http.stream("POST", url + path, json=body) as r:
            result.statuses[r.status_code] += 1
            if r.status_code != 200:
                result.errors.append(f"{label}: {r.status_code} {(await r.aread())[:300]!r}")
                return
            events, stop_after = [], rng.randrange(0, 12) if leave else None
            async for line in r.aiter_lines():
                if stop_after is not None and len(events) >= stop_after:
                    result.disconnects += 1
                    return  # leaving the block closes the connection mid-stream
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
            if not events or events[-1] != "[DONE]":
                result.errors.append(f"{label}: the stream ended without [DONE]")
            elif any('"error"' in e and "error" in json.loads(e) for e in events[:-1]):
                result.errors.append(f"{label}: error event {[e for e in events if 'error' in e][:1]}")
            else:
                result.completed += 1
        return
    timeout = httpx.Timeout(60, read=rng.uniform(0.02, 0.4)) if leave else httpx.Timeout(120)
    try:
        r = await http.post(url + path, json=body, timeout=timeout)
    except httpx.ReadTimeout:
        if not leave:
            raise
        result.disconnects += 1
        return
    result.statuses[r.status_code] += 1
    if r.status_code != 200:
        result.errors.append(f"{label}: {r.status_code} {r.text[:300]}")
    else:
        result.completed += 1


async def client_loop(url: str, headers: dict, seed: int, traffic: Traffic, result: SoakResult, until: float,
                      leave_rate: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(headers=headers, timeout=120) as http:
        while time.monotonic() < until:
            try:
                await one_request(http, url, rng, traffic, result, leave_rate)
            except httpx.HTTPError as exc:
                result.errors.append(f"transport error: {type(exc).__name__}: {exc}")


def run_soak(url: str, model: str, duration_s: float, clients: int, seed: int, leave_rate: float = 0.25,
             headers: dict | None = None, max_prompt_words: int = 300) -> SoakResult:
    result = SoakResult(seed=seed)
    traffic = Traffic(model, seed, max_prompt_words)
    started = time.monotonic()

    async def all_clients() -> None:
        until = time.monotonic() + duration_s
        await asyncio.gather(*(client_loop(url, headers or {}, seed * 1000 + i, traffic, result, until, leave_rate)
                               for i in range(clients)))

    asyncio.run(all_clients())
    result.duration_s = time.monotonic() - started
    return result


def probe(url: str, model: str, headers: dict | None = None) -> tuple[str, list[str]]:
    """The greedy answer to a fixed prompt: its text and its tokens."""
    body = {"model": model, "prompt": PROBE, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=60)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def pool_state(url: str, headers: dict | None = None) -> dict:
    """KV blocks by state and the request gauges, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=headers or {}).text):
        for s in family.samples:
            if s.name == "kvreuse_kv_blocks":
                out[s.labels["state"]] = s.value
            elif s.name in ("kvreuse_kv_blocks_total", "kvreuse_requests_running", "kvreuse_requests_waiting",
                            "kvreuse_blended_tokens_total", "kvreuse_evicted_blocks_total",
                            "kvreuse_preemptions_total", "kvreuse_prefix_cache_hits_total"):
                out[s.name.removeprefix("kvreuse_")] = s.value
    return out


def settled_pool(url: str, headers: dict | None = None, timeout: float = 30.0) -> dict:
    """The pool once nothing runs or waits and no block is in use, or as it is when `timeout` runs out."""
    deadline = time.monotonic() + timeout
    while True:
        state = pool_state(url, headers)
        if (state["in_use"] == 0 and state["requests_running"] == 0 and state["requests_waiting"] == 0) \
                or time.monotonic() > deadline:
            return state
        time.sleep(0.1)
