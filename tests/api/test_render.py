"""vLLM's render endpoints (POST /v1/completions/render, /v1/chat/completions/render), which a KV-aware router
calls to hash a prompt into blocks: the token ids must be exactly those the generating route computes. Checked
against the real routes of a real server: the same prompt length, and the rendered ids sent back as a token
prompt hit the blocks the chat request cached, to the block; and against the checkpoint's own tokenizer."""
from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from server_process import running_server

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                 {"type": "text", "text": "in Paris and in Rome today?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def url(tiny_llama_path, tmp_path_factory):
    with running_server(tiny_llama_path, tmp_path_factory.mktemp("render") / "s.log", "--block-size", str(BS),
                        "--num-gpu-blocks", "512", "--no-blend-key-shift") as url:
        yield url


def post(url, path, body):
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)


def test_chat_render_is_the_prompt_the_chat_route_computes(url):
    rendered = post(url, "/v1/chat/completions/render", {"messages": MESSAGES, "tools": TOOLS})
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["token_ids"]
    assert ids and all(isinstance(t, int) for t in ids)
    chat = post(url, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    # the rendered ids as a token prompt find every full block the chat request cached
    again = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens"] == len(ids)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(ids) - 1) // BS * BS
    # tools are part of the prompt
    without = post(url, "/v1/chat/completions/render", {"messages": MESSAGES[:2]}).json()["token_ids"]
    assert len(without) < len(ids)


def test_plain_chat_render_is_the_templates_own(url, tiny_llama_path):
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    ids = post(url, "/v1/chat/completions/render", {"messages": messages}).json()["token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == list(expected["input_ids"])


def test_completion_render_is_the_tokenized_prompt(url, tiny_llama_path):
    text = "The quick brown fox jumps over the lazy dog."
    rendered = post(url, "/v1/completions/render", {"prompt": text}).json()
    assert isinstance(rendered, list) and len(rendered) == 1
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    assert rendered[0]["token_ids"] == tokenizer.encode(text) and rendered[0]["model"] == "tiny"
    done = post(url, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(rendered[0]["token_ids"])
    assert post(url, "/v1/completions/render", {"prompt": [5, 6, 7]}).json()[0]["token_ids"] == [5, 6, 7]


def test_bad_render_requests_are_client_errors(url):
    assert post(url, "/v1/completions/render", {"prompt": ""}).status_code == 400
    assert post(url, "/v1/chat/completions/render", {"messages": []}).status_code == 400
    assert httpx.post(url + "/v1/completions/render", json={"model": "other", "prompt": "x"}).status_code == 404
