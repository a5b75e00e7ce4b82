"""Prompt caching as Claude Code uses it (issue #43), with the real `claude -p` against a Gemma 3 270M server:
its first request's cache writes are the tokens up to its last `cache_control` breakpoint, and the prefix it
pinned there outlives a flood of other prompts that evicts every unpinned block.

The breakpoint's token count is found here without the server's span bookkeeping (api/cache_breakpoints.py):
the conversation is cut right after the last marked block and rendered (vLLM's render route) twice, once
ending there and once with one more text block after it; the two prompts share exactly the tokens up to the
breakpoint, whatever the template puts after it.
"""
from __future__ import annotations

import os
import random
import string
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coding_agents import (AGENT_TIMEOUT, ANSWER_CAP, CLAUDE_TASKS, AgentRun, ClaudeCode, ClaudeResult,
                           claude_main_requests)
from loadgen.recording_proxy import Exchange, recording_proxy
from reuse_server.api.messages import chat_request
from reuse_server.api.messages_protocol import MessagesRequest

pytestmark = [pytest.mark.agents, pytest.mark.server, pytest.mark.timeout(3600)]

CONTROL_TOKENS = 600  # about; the unpinned prompt that must not survive the flood
FLOOD_PROMPT_TOKENS = 2500  # about; each flood prompt, well inside what the unpinned part of the pool holds
PIN_TTL = 300.0  # Claude Code's marks carry no ttl: Anthropic's default, 5 minutes


def _render(client: httpx.Client, url: str, chat: dict, messages: list[dict]) -> list[int]:
    response = client.post(url + "/v1/chat/completions/render", json={**chat, "messages": messages})
    assert response.status_code == 200, response.text[:500]
    return response.json()["token_ids"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def breakpoint_tokens(url: str, exchange: Exchange) -> tuple[int, int]:
    """(tokens up to the request's last cache_control breakpoint, tokens of its whole prompt), from renderings
    of the conversation cut at the last marked block."""
    body = MessagesRequest.model_validate(exchange.request_json)
    chat = chat_request(body).model_dump(mode="json", exclude_none=True)
    chat.update(stream=False, max_tokens=1)
    messages = chat["messages"]
    marked = [(i, j) for i, m in enumerate(messages) if isinstance(m.get("content"), list)
              for j, part in enumerate(m["content"]) if part.get("cache_control")]
    assert marked, f"no cache_control mark in {exchange.path}"
    i, j = marked[-1]
    head = messages[:i]
    upto = {**messages[i], "content": messages[i]["content"][:j + 1]}
    more = {**messages[i], "content": upto["content"] + [{"type": "text", "text": "One more block."}]}
    with httpx.Client(timeout=None) as client:
        whole = _render(client, url, chat, messages)
        ending_there = _render(client, url, chat, head + [upto])
        going_on = _render(client, url, chat, head + [more])
    tokens = _common_prefix(ending_there, going_on)
    assert whole[:tokens] == ending_there[:tokens], "the cut conversation's prompt is no prefix of the request's"
    return tokens, len(whole)


def _claude_ok(run: AgentRun) -> Exchange:
    """The turn's first agent-loop request, after checking the turn got no API error."""
    result = ClaudeResult.of(run)
    assert result.api_error is None, f"API error: {result.api_error}\n{run.describe()}"
    assert run.returncode == 0 or result.hit_output_cap, run.describe()
    assert claude_main_requests(run), f"claude sent no agent request\n{run.describe()}"
    assert all(e.status == 200 for e in run.generations()), run.describe()
    return claude_main_requests(run)[0]


def test_first_request_writes_the_tokens_up_to_its_last_breakpoint(claude_session, gemma_server):
    first = _claude_ok(claude_session.first)
    upto_breakpoint, prompt = breakpoint_tokens(gemma_server[0], first)
    usage = first.usage()
    print(f"Claude Code's first request: {prompt} prompt tokens, its last breakpoint at {upto_breakpoint}: {usage}")
    # what the cache held already is read, not written; the rest up to the breakpoint is written
    assert usage["cache_read_input_tokens"] < upto_breakpoint, usage
    assert usage["cache_creation_input_tokens"] == upto_breakpoint - usage["cache_read_input_tokens"], usage
    assert usage["input_tokens"] == prompt - upto_breakpoint, usage
    assert usage["cache_creation"]["ephemeral_5m_input_tokens"] == usage["cache_creation_input_tokens"], usage


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics samples by (name, labels)."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _pool(url: str) -> dict[str, int]:
    m = _metrics(url)
    return {"total": int(m[("kvreuse_kv_blocks_total", ())]),
            "pinned": int(m[("kvreuse_kv_blocks", (("state", "pinned"),))]),
            "evictable": int(m[("kvreuse_kv_blocks", (("state", "evictable"),))]),
            "evicted": int(m[("kvreuse_evicted_blocks_total", ())]),
            "given_way": int(m[("kvreuse_kv_pins_given_way_total", ())])}


def _random_text(rng: random.Random, tokens: int) -> str:
    """Lowercase nonsense words, about `tokens` tokens (about two a word on Gemma's tokenizer)."""
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(tokens // 2))


def _complete(client: httpx.Client, url: str, model: str, prompt: str) -> dict:
    """A plain /v1/completions of one token; its usage."""
    response = client.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text[:500]
    return response.json()["usage"]


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_pinned_prefix_survives_a_flood_that_evicts_everything_else(gemma_server, tmp_path):
    url, model, context_window = gemma_server
    block_size = httpx.get(url + "/server_info").json()["block_size"]
    seed = int(os.environ.get("AGENTS_FLOOD_SEED") or random.randrange(2**32))
    print(f"flood seed {seed} (AGENTS_FLOOD_SEED={seed} repeats it)")
    rng = random.Random(seed)
    with recording_proxy(url) as (proxy_url, proxy), httpx.Client(timeout=None) as client:
        # a session of its own, so the pins are this test's, made just now (they live 5 minutes)
        claude = ClaudeCode.for_server(tmp_path / "home", tmp_path / "work", proxy_url, model, context_window,
                                       ANSWER_CAP)
        first = _claude_ok(claude.turn(proxy, CLAUDE_TASKS[0], first=True, timeout=AGENT_TIMEOUT))
        pinned_at = time.monotonic()
        upto_breakpoint, _ = breakpoint_tokens(url, first)
        before = _pool(url)
        assert before["pinned"] >= upto_breakpoint // block_size, (upto_breakpoint, before)

        control = _random_text(rng, CONTROL_TOKENS)
        _complete(client, url, model, control)
        assert _cached(_complete(client, url, model, control)) > 0, "the control prompt was not cached at all"

        # LRU order: once the flood has filled every unpinned block of the pool with its own (never read
        # again), nothing unpinned from before it is left
        pool = _pool(url)
        to_fill = (pool["total"] - pool["pinned"]) * block_size
        flooded = 0
        while flooded < to_fill + block_size:
            flooded += _complete(client, url, model, _random_text(rng, FLOOD_PROMPT_TOKENS))["prompt_tokens"]
        after = _pool(url)
        assert after["evicted"] - pool["evicted"] >= pool["evictable"], (pool, after)
        assert after["pinned"] == pool["pinned"] and after["given_way"] == pool["given_way"], (pool, after)
        assert _cached(_complete(client, url, model, control)) == 0, "the unpinned control prompt survived the flood"

        elapsed = time.monotonic() - pinned_at
        continued = _claude_ok(claude.turn(proxy, CLAUDE_TASKS[1], first=False, timeout=AGENT_TIMEOUT))
    read = continued.usage()["cache_read_input_tokens"]
    print(f"flooded {flooded} tokens over a pool of {pool['total']} blocks ({pool['pinned']} pinned) in "
          f"{elapsed:.0f} s; the continued turn read {read} cached tokens, the breakpoint is at {upto_breakpoint}")
    assert read >= upto_breakpoint, (
        f"after the flood, `claude -p --continue` read {read} cached tokens, short of the {upto_breakpoint} "
        f"pinned up to its first turn's last breakpoint" + (f" (but {elapsed:.0f} s passed: the pins' 5 minutes "
                                                           "were up)" if elapsed >= PIN_TTL else ""))
