"""Anthropic's Messages API with the official `anthropic` SDK against a real server (tiny checkpoint, API
keys on): create, stream, count_tokens, a tool round trip, stop sequences, x-api-key and Bearer, and errors in
Anthropic's shape. The tiny model's calls are valid only because decoding is constrained."""
import json

import anthropic
import httpx
import jsonschema
import pytest

from server_process import running_server
from test_tool_calls import WEATHER

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
KEY = "messages-key"
USER = [{"role": "user", "content": "Tell me about the weather in Paris."}]
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
GREEDY = {"temperature": 0}  # the SDK 2.x has no temperature argument; older clients send it in the body


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("messages-server") / "server.log"
    with running_server(tiny_llama_path, log_path, "--block-size", "4", "--num-gpu-blocks", "1024",
                        "--max-model-len", "2048", "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_reports_usage_as_anthropic_defines_it(client):
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model=MODEL, max_tokens=12, system=system, messages=USER, extra_body=GREEDY,
                                   cache_control={"type": "ephemeral"})
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens >= 1
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=USER).input_tokens
    # the breakpoints (the system block, and the top-level one on the last block) wrote the prompt up to the
    # end of the question; input_tokens are the rest (tests/api/test_prompt_caching.py checks the figures)
    assert first.usage.cache_creation_input_tokens > 0
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens \
        + first.usage.cache_creation_input_tokens == counted
    again = client.messages.create(model=MODEL, max_tokens=12, system=system, messages=USER, extra_body=GREEDY)
    # the same prompt again: all of it but the last block reused, and input_tokens only the rest
    assert again.usage.cache_read_input_tokens >= counted - 4 and again.usage.input_tokens <= 4
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted
    assert text_of(again) == text_of(first)
    if first.usage.output_tokens == 12:
        assert first.stop_reason == "max_tokens"


def test_stream_assembles_the_same_message(client):
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY)
    names = []
    with client.messages.stream(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY) as stream:
        for event in stream:
            names.append(event.type)
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert names[0] == "message_start" and names[-1] == "message_stop" and "message_delta" in names
    assert "content_block_start" in names and "content_block_stop" in names


def test_raw_stream_has_anthropic_event_names_and_a_ping(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": USER, "stream": True}
    with httpx.stream("POST", server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        frames = r.read().decode().split("\n\n")
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames if f]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    for frame in filter(None, frames):
        name, data = frame.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")


def test_stop_sequence_is_reported(client):
    """A stop sequence taken from the greedy answer itself ends the same answer there."""
    whole = text_of(client.messages.create(model=MODEL, max_tokens=24, messages=USER, extra_body=GREEDY))
    stop = next((whole[i:i + 3] for i in range(2, len(whole) - 3) if whole[i:i + 3].strip() == whole[i:i + 3]
                 and whole.find(whole[i:i + 3]) == i), None)
    if stop is None:
        pytest.skip(f"no usable stop sequence in {whole!r}")
    cut = client.messages.create(model=MODEL, max_tokens=24, messages=USER, stop_sequences=[stop, "\x00never"],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == whole[:whole.find(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    kw = dict(model=MODEL, max_tokens=200, messages=USER, tools=[TOOL], tool_choice={"type": "any"},
              extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kw) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(**kw)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and all(b.name == "get_weather" and b.id.startswith("toolu_") for b in uses)
    for b in uses:
        jsonschema.validate(b.input, TOOL["input_schema"])
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "Sunny, 21 degrees."} for b in uses]
    follow = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": results}]
    second = client.messages.create(model=MODEL, max_tokens=4, messages=follow, tools=[TOOL], extra_body=GREEDY)
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt - 4  # the whole first prompt, to its last block


def test_one_tool_when_parallel_use_is_disabled(client):
    first = client.messages.create(model=MODEL, max_tokens=120, messages=USER, tools=[TOOL], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True})
    assert [b.type for b in first.content] == ["tool_use"] and first.stop_reason == "tool_use"


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "'image'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "tool_use"),
    ({"max_tokens": 4, "messages": USER + [{"role": "assistant", "content": "Sure"}]}, "prefill"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "nope"),
    ({"max_tokens": 4, "messages": USER, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
     "mcp_servers"),
])
def test_malformed_requests_are_400_in_anthropic_shape(server, body, words):
    response = httpx.post(server + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_sdk_raises_its_own_errors(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=USER)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=USER)
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=USER)
    assert unauthorized.value.body["error"]["type"] == "authentication_error"


def test_bearer_key_also_works_and_openai_routes_keep_their_shape(server):
    ok = httpx.post(server + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": USER},
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    chat = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": []},
                      headers={"x-api-key": KEY}, timeout=60)
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "invalid_request_error"
