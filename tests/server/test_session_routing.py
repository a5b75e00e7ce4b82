"""A coding agent's session stays on one replica behind `reuse-server cluster --router vllm-router` (vllm-router
0.1.17, its kv_aware policy, with the session affinity the cluster turns on): requests shaped as the real CLIs
send them (captured from Codex CLI 0.171 and Claude Code 2.1: Codex's `session-id` / `thread-id` headers and
`prompt_cache_key`, Claude Code's `X-Claude-Code-Session-Id` header and `metadata.user_id`), several sessions of
three streamed turns, each turn the whole conversation so far plus one new message.

Which replica served a turn is read from each replica's /metrics; that a later turn landed where the session's
earlier turns ran is read from its cached prompt tokens (the replicas share no Redis here, so only the replica
that ran the previous turn holds the conversation).

Why the key is what keeps a session in place here: the router cannot tokenize /v1/responses or /v1/messages,
so a request it places by itself goes to the least loaded replica. The first turns of all sessions are sent at
once, which spreads them over both replicas by load; the later turns are sent one at a time to an idle
cluster, where the least loaded replica is always the same one, so without the key every session that began
on the other replica would move."""
from __future__ import annotations

import json
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from reuse_server.server.cluster import gateway, replica_set
from server_process import requests_finished

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
SESSIONS = 4
WORDS = ("river salt wool grain trader spring market bridge tower harbor winter lantern copper meadow orchard "
         "archive signal engine quarry garden mirror").split()
INSTRUCTIONS = "You are a coding agent."  # what every session of an agent shares


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    """Two replicas behind vllm-router's kv_aware, with the flags `reuse-server cluster --router vllm-router`
    gives it (session affinity on)."""
    logs = tmp_path_factory.mktemp("session-routing")
    args = ["--model", str(tiny_llama_path), "--served-model-name", "tiny", "--block-size", str(BS),
            "--num-gpu-blocks", "256", "--no-blend-key-shift"]
    with replica_set(2, args, logs, kv_events=True) as replicas, \
            gateway([r.url for r in replicas], "kv_aware", logs, router="vllm-router") as (url, _):
        yield url, [r.url for r in replicas]


class Codex:
    """POST /v1/responses as `codex exec` and `codex exec resume` send it: the session id in the session-id and
    thread-id headers and in prompt_cache_key (and client_metadata), streamed, not stored."""
    path = "/v1/responses"

    @staticmethod
    def request(session: str, history: list[tuple[str, str]], message: str, max_tokens: int) -> tuple[dict, dict]:
        items = []
        for user, answer in history:
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]})
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": answer}]})
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": message}]})
        body = {"model": "tiny", "instructions": INSTRUCTIONS, "input": items, "stream": True, "store": False,
                "max_output_tokens": max_tokens, "prompt_cache_key": session,
                "client_metadata": {"session_id": session, "thread_id": session, "turn_id": str(uuid.uuid4())}}
        headers = {"session-id": session, "thread-id": session, "x-client-request-id": session,
                   "originator": "codex_exec", "accept": "text/event-stream", "authorization": "Bearer unused"}
        return body, headers

    @staticmethod
    def answer(events: list[dict]) -> tuple[str, int, int]:
        """(output text, prompt tokens, cached prompt tokens) from the last event: response.completed, or
        response.incomplete where max_output_tokens cut the answer."""
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        done = events[-1]["response"]
        text = "".join(part["text"] for item in done["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
        usage = done["usage"]
        return text, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


class ClaudeCode:
    """POST /v1/messages?beta=true as `claude -p` sends it: the session id in the X-Claude-Code-Session-Id
    header and inside metadata.user_id (a JSON string), streamed."""
    path = "/v1/messages?beta=true"

    @staticmethod
    def request(session: str, history: list[tuple[str, str]], message: str, max_tokens: int) -> tuple[dict, dict]:
        messages = []
        for user, answer in history:
            messages += [{"role": "user", "content": [{"type": "text", "text": user}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        messages.append({"role": "user", "content": [{"type": "text", "text": message}]})
        user_id = json.dumps({"device_id": "0" * 64, "account_uuid": "", "session_id": session})
        body = {"model": "tiny", "system": [{"type": "text", "text": INSTRUCTIONS}], "messages": messages,
                "max_tokens": max_tokens, "stream": True, "metadata": {"user_id": user_id}}
        headers = {"X-Claude-Code-Session-Id": session, "x-app": "cli", "anthropic-version": "2023-06-01",
                   "x-api-key": "unused", "accept": "application/json"}
        return body, headers

    @staticmethod
    def answer(events: list[dict]) -> tuple[str, int, int]:
        """(output text, prompt tokens, cached prompt tokens) from message_start / message_delta."""
        text = "".join(e["delta"]["text"] for e in events
                       if e.get("type") == "content_block_delta" and e["delta"].get("type") == "text_delta")
        usage = next(e["usage"] for e in reversed(events) if e.get("type") == "message_delta")
        cached = usage["cache_read_input_tokens"]
        return text, usage["input_tokens"] + cached, cached


def turn(router: str, agent, session: str, history: list[tuple[str, str]], message: str,
         max_tokens: int = 8) -> tuple[str, int, int]:
    body, headers = agent.request(session, history, message, max_tokens)
    events = []
    with httpx.stream("POST", router + agent.path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return agent.answer(events)


def served_by(replicas: list[str], before: list[float]) -> int:
    """The one replica whose finished requests grew since `before` (it counts a request just after its answer
    has left, hence the bounded wait)."""
    deadline = time.monotonic() + 30
    while not (grew := [i for i, u in enumerate(replicas) if requests_finished(u) > before[i]]):
        assert time.monotonic() < deadline, "no replica finished the request"
        time.sleep(0.05)
    assert len(grew) == 1, grew
    return grew[0]


def words(rng: random.Random, n: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.mark.parametrize("agent", [Codex, ClaudeCode], ids=["codex", "claude-code"])
def test_every_turn_of_a_session_lands_on_the_replica_that_holds_it_and_sessions_spread(cluster, agent):
    router, replicas = cluster
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    sessions = {str(uuid.uuid4()): [] for _ in range(SESSIONS)}
    last_prompt = {}  # the prompt tokens of each session's latest turn

    # first turns all at once: with no replica holding anything of them, the router spreads them by load
    before = [requests_finished(u) for u in replicas]
    with ThreadPoolExecutor(SESSIONS) as pool:
        firsts = {s: (message, pool.submit(turn, router, agent, s, [], message, 32))
                  for s, message in ((s, words(rng)) for s in sessions)}
        for s, (message, future) in firsts.items():
            text, last_prompt[s], _ = future.result()
            sessions[s].append((message, text))
    deadline = time.monotonic() + 30
    while sum(requests_finished(u) for u in replicas) < sum(before) + SESSIONS:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    firsts_per_replica = [requests_finished(u) - b for u, b in zip(replicas, before)]
    assert all(n > 0 for n in firsts_per_replica), firsts_per_replica  # both replicas began sessions

    # later turns one at a time, on an idle cluster: the session key alone says where each goes
    placed = {s: [] for s in sessions}
    for _ in range(2):
        for s, history in sessions.items():
            before_turn = [requests_finished(u) for u in replicas]
            message = words(rng)
            text, prompt_tokens, cached = turn(router, agent, s, history, message)
            placed[s].append(served_by(replicas, before_turn))
            # the conversation so far was held where the turn ran: the previous turn's prompt in full blocks,
            # but for the last one (where the previous answer begins, which may tokenize otherwise in history);
            # far more than the instructions and template every session of the agent shares
            assert cached >= (last_prompt[s] // BS - 1) * BS, (s, cached, last_prompt[s])
            last_prompt[s] = prompt_tokens
            history.append((message, text))
    print("replica of each session's later turns", placed)
    assert all(len(set(turns)) == 1 for turns in placed.values()), placed
    assert {turns[0] for turns in placed.values()} == {0, 1}, placed  # sessions on both replicas

