"""Prompt caching as Anthropic's Messages API defines it, through the `anthropic` SDK against an in-process
server on the tiny checkpoint whose engine runs on a clock the test sets (no sleeping): cache_control
breakpoints are written (cache_creation_input_tokens, split 5m/1h) then read, the pinned prefix survives a
flood that evicts everything else until its time is up, and OpenAI's chat reports cache_write_tokens.
Expected offsets come from the tokenizer directly: each chunk (a block's text, the template's framing between
them) is tokenized alone."""
from __future__ import annotations

import random

import anthropic
import httpx
import pytest

from inprocess_server import serving
from server_process import metric, scrape
from reuse_server.engine.async_engine import AsyncEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig

pytestmark = pytest.mark.server

MODEL = "tiny"
SEED = 8675309
WORDS = "cache block prefix pin reuse token model server paris weather query answer radix tree".split()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def text(n: int, salt: int) -> str:
    rng = random.Random(SEED + salt)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    clock = Clock()
    print(f"seed {SEED}")

    def build():
        engine = build_engine(EngineConfig(model=str(tiny_llama_path), served_model_name=MODEL, block_size=4,
                                           num_gpu_blocks=160, max_model_len=1024, max_pinned_share=0.5))
        engine.clock = clock
        return engine

    engine = AsyncEngine.launch(build)
    with serving(engine) as url:
        yield url, engine.engine, clock


def count(tokenizer, piece: str) -> int:
    return len(tokenizer.encode(piece, add_special_tokens=False))


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/cache/stats").json()["pins"]


def test_breakpoints_are_written_then_read_split_by_ttl_and_streamed_alike(served):
    url, engine, clock = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    tok = engine.tokenizer
    system_text, question = text(40, 1), text(12, 2)
    system = [{"type": "text", "text": system_text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": question,
                                              "cache_control": {"type": "ephemeral"}}]}]
    system_end = count(tok, "<|im_start|>system\n") + count(tok, system_text)
    user_end = system_end + count(tok, "<|im_end|>\n<|im_start|>user\n") + count(tok, question)
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens

    first = client.messages.create(model=MODEL, max_tokens=2, system=system, messages=messages,
                                   extra_body={"temperature": 0})
    usage = first.usage
    assert usage.cache_creation_input_tokens == user_end and usage.cache_read_input_tokens == 0
    assert usage.cache_creation.ephemeral_1h_input_tokens == system_end
    assert usage.cache_creation.ephemeral_5m_input_tokens == user_end - system_end
    assert usage.input_tokens == counted - user_end  # the framing after the last breakpoint
    pins = stats(url)
    # the blocks up to the last breakpoint, the one it falls in included (the prompt goes on past it)
    assert pins["pinned_blocks"] == -(-user_end // 4) and pins["tenants"]["default"]["pins"] == 2

    with client.messages.stream(model=MODEL, max_tokens=2, system=system, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    for u in (start, final):  # the same request again: the marked prefix is read, nothing written
        assert u.cache_read_input_tokens >= user_end and u.cache_creation_input_tokens == 0
        assert u.cache_creation.ephemeral_5m_input_tokens == u.cache_creation.ephemeral_1h_input_tokens == 0
        assert u.input_tokens + u.cache_read_input_tokens == counted


def test_a_pinned_prefix_survives_a_flood_until_its_ttl_and_top_level_cache_control_marks_the_last_block(served):
    url, engine, clock = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    tok = engine.tokenizer
    question = text(30, 10)
    messages = [{"role": "user", "content": question}]
    end = count(tok, "<|im_start|>user\n") + count(tok, question)
    first = client.messages.create(model=MODEL, max_tokens=2, messages=messages, extra_body={"temperature": 0},
                                   cache_control={"type": "ephemeral"})  # automatic: on the last block, 5m
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == end
    evicted = engine.cache.stats().evicted_blocks
    for i in range(6):  # ~105 blocks each of a 160-block pool: everything unpinned goes
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": text(100, 100 + i), "max_tokens": 1},
                   timeout=120).raise_for_status()
        clock.now += 30
    assert engine.cache.stats().evicted_blocks - evicted > 160
    again = client.messages.create(model=MODEL, max_tokens=2, messages=messages, extra_body={"temperature": 0})
    assert again.usage.cache_read_input_tokens >= end, "the pinned prefix did not survive the flood whole"

    clock.now += 301  # past the 5 minutes the last read renewed
    for i in range(6):
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": text(100, 200 + i), "max_tokens": 1},
                   timeout=120).raise_for_status()
    late = client.messages.create(model=MODEL, max_tokens=2, messages=messages, extra_body={"temperature": 0})
    assert late.usage.cache_read_input_tokens < end // 4 * 4, "an expired pin still kept its prefix"


def test_openai_chat_takes_cache_control_on_parts_and_reports_cache_write_tokens(served):
    url, engine, clock = served
    content = [{"type": "text", "text": text(30, 20), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    first = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["usage"]
    details = first["prompt_tokens_details"]
    assert details["cached_tokens"] < 8  # the user header at most: the text is new
    assert details["cache_write_tokens"] == first["prompt_tokens"] // 4 * 4 - details["cached_tokens"] > 20
    again = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["usage"]
    assert again["prompt_tokens_details"]["cache_write_tokens"] == 0
    bad = {**body, "messages": [{"role": "user", "content": [{**content[0], "cache_control": {"type": "ephemeral",
                                                                                              "ttl": "2h"}}]}]}
    r = httpx.post(url + "/v1/chat/completions", json=bad, timeout=120)
    assert r.status_code == 400 and "cache_control" in r.text
    five = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                               "messages": [{"role": "user", "content": five}]}, timeout=120)
    assert r.status_code == 400 and "maximum of 4" in r.json()["error"]["message"]
    samples = scrape(url)  # the first request's 1h pin holds the blocks up to its part's end; no request runs
    pinned = engine.cache.stats().pinned_blocks
    assert pinned > 0 and metric(samples, "kvreuse_kv_blocks", state="pinned") == pinned
    assert metric(samples, "kvreuse_kv_blocks", state="in_use") == 0
