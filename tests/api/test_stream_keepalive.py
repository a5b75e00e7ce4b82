"""A long prompt's stream is not silent until its first token: a real server around a real engine whose
prefill step is made to block (tests/fault_injection.py) sends Anthropic's message_start as soon as the
request is admitted (with the prompt's prefix match in its usage), then a ping every --sse-keepalive seconds
of silence; OpenAI's streams send SSE comment lines. Clients with a read timeout shorter than the prefill
(the official SDKs, max_retries=0) get their whole answer in one request instead of timing out."""
import json
import threading

import anthropic
import httpx
import openai
import pytest

from fault_injection import launch_hanging
from inprocess_server import serving
from reuse_server.api.settings import ServerSettings
from reuse_server.engine.config import EngineConfig

pytestmark = pytest.mark.server  # starts a server

MODEL = "tiny"
KEEPALIVE = 0.2  # seconds: the server's --sse-keepalive here
READ_TIMEOUT = 2.0  # the clients' read timeout: longer than KEEPALIVE, shorter than the blocked prefill
SAFETY = 120  # seconds: a deadline for a slow machine, never what a test measures
SYSTEM = "You are a terse assistant who answers every question about the weather in one short line."
QUESTION = [{"role": "user", "content": "Is it raining in Paris today?"}]


@pytest.fixture
def blocked_prefill(tiny_llama_path):
    """A server whose engine steps normally until `hang` is set; the next step (the prefill of the request
    sent then) blocks until `release`. A safety timer releases it whatever the test does."""
    engine, switches = launch_hanging(EngineConfig(model=str(tiny_llama_path), served_model_name=MODEL,
                                                   block_size=4, num_gpu_blocks=1024), step_timeout=SAFETY * 10)
    safety = threading.Timer(SAFETY, switches.release.set)
    safety.start()
    with serving(engine, ServerSettings(sse_keepalive=KEEPALIVE)) as url:
        yield url, engine, switches
    safety.cancel()
    switches.release.set()


def sse_frames(lines):
    """(kind, name or text, data) per SSE frame: ("event", name, payload), ("data", None, payload) for an
    unnamed one, ("comment", text, None)."""
    name = None
    for line in lines:
        if line.startswith(":"):
            yield "comment", line[1:].strip(), None
        elif line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            yield ("event", name, json.loads(data)) if name else ("data", None, data)
            name = None


def requests_served(engine) -> int:
    """Prompts the engine computed to the end (each request's once): a retried request would count twice."""
    return engine.engine.counters["prompt_tokens"]  # counted in the step, before its outputs leave


def test_messages_stream_starts_at_admission_and_pings_through_a_blocked_prefill(blocked_prefill):
    url, engine, switches = blocked_prefill
    body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "messages": QUESTION, "temperature": 0}
    prompt_tokens = httpx.post(url + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
    httpx.post(url + "/v1/messages", json=body, timeout=SAFETY).raise_for_status()  # its prefix is cached now
    switches.hang.set()
    names, during_prefill = [], None
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=SAFETY) as r:
        assert r.status_code == 200
        for kind, name, data in sse_frames(r.iter_lines()):
            assert kind == "event", (kind, name)  # no comment lines on Anthropic's stream: its own ping event
            names.append(name)
            if name == "message_start":
                start = data["message"]["usage"]
            if names.count("ping") == 3 and during_prefill is None:
                # message_start's ping and two sent in the silence, all while the prefill step is blocked
                during_prefill = switches.hung.is_set() and not switches.release.is_set()
                switches.release.set()
            if name == "message_delta":
                final = data["usage"]
    assert during_prefill is True
    first_block = names.index("content_block_start")
    assert names[0] == "message_start" and set(names[1:first_block]) == {"ping"} and first_block >= 4, names
    assert names[-2:] == ["message_delta", "message_stop"]
    # message_start's usage is the admission's prefix match, the same as the final usage reports (no blending)
    assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"] > 0
    assert start["input_tokens"] + start["cache_read_input_tokens"] + start["cache_creation_input_tokens"] \
        == prompt_tokens
    assert start["output_tokens"] == 0


def test_anthropic_sdk_with_a_short_read_timeout_gets_its_answer_through_a_long_prefill(blocked_prefill):
    url, engine, switches = blocked_prefill
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0,
                                 timeout=anthropic.Timeout(SAFETY, read=READ_TIMEOUT))
    switches.hang.set()
    with client.messages.stream(model=MODEL, max_tokens=4, system=SYSTEM, messages=QUESTION) as stream:
        events = iter(stream)
        first = next(events)
        assert first.type == "message_start"  # the SDK drops pings: the next event is the first token's
        assert switches.hung.is_set() and not switches.release.is_set()  # ... while the prefill is blocked
        released = threading.Timer(3 * READ_TIMEOUT, switches.release.set)  # the prefill outlasts the timeout,
        released.start()  # with the client reading meanwhile
        rest = [event.type for event in events]
        released.join()
        message = stream.get_final_message()
    assert rest[0] == "content_block_start" and rest[-1] == "message_stop"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens >= 1
    assert requests_served(engine) == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_openai_streams_send_comment_lines_through_a_long_prefill(blocked_prefill):
    url, engine, switches = blocked_prefill
    switches.hang.set()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=openai.Timeout(SAFETY, read=READ_TIMEOUT))
    stream = client.chat.completions.create(model=MODEL, max_tokens=4, stream=True,
                                            messages=[{"role": "system", "content": SYSTEM}, *QUESTION])
    released = threading.Timer(3 * READ_TIMEOUT, switches.release.set)  # the prefill outlasts the read timeout
    released.start()
    chunks = list(stream)  # the openai SDK skips the comment lines
    released.join()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks)

    switches.hung.clear()
    switches.release.clear()
    comments, data = 0, []
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=SAFETY) as r:
        for kind, text, payload in sse_frames(r.iter_lines()):
            if kind == "comment":
                assert text == "keepalive" and not data  # the silence is before the first chunk
                comments += 1
                if comments == 2:
                    assert switches.hung.is_set() and not switches.release.is_set()
                    switches.release.set()
            else:
                data.append(payload)
    assert comments >= 2 and data[-1] == "[DONE]" and len(data) >= 2
