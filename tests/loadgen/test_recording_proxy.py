"""The recording proxy (loadgen/recording_proxy.py) between the official SDKs and a real server: what the
client gets is what the server sent, and the recording holds each request as sent and each answer whole, its
usage read as the SDK read it, streamed or not, in both agent dialects."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from loadgen.recording_proxy import recording_proxy
from server_process import metric, running_server, scrape, wait_idle

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

PROMPT = "a prompt long enough to fill a few blocks of the cache " * 6


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("proxy-server") / "server.log"
    with running_server(tiny_llama_path, log, "--block-size", "16") as url:
        yield url


def test_a_responses_stream_is_passed_through_and_recorded(server):
    with recording_proxy(server) as (url, proxy):
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        finals = []
        for _ in range(2):  # the second finds the first's prompt cached
            # cut by max_output_tokens, so the stream ends with response.incomplete, whose usage counts too
            *_, last = client.responses.create(model="tiny", input=PROMPT, max_output_tokens=4, stream=True)
            assert last.type == "response.incomplete"
            finals.append(last.response)
        recorded = proxy.snapshot()
    assert [(e.method, e.path, e.status, e.streamed) for e in recorded] == [("POST", "/v1/responses", 200, True)] * 2
    for exchange, final in zip(recorded, finals):
        assert exchange.request_json["input"] == PROMPT and exchange.request_json["stream"] is True
        assert exchange.request_headers["authorization"] == "Bearer k"
        assert exchange.usage() == final.usage.model_dump(exclude_none=True)
        assert exchange.response_body.count(b"event: response.incomplete") == 1
        # timed at its first text delta, which came before the stream's end (four tokens, then the final event)
        assert b'"type":"response.output_text.delta"' in exchange.response_body.replace(b" ", b"")
        assert 0 < exchange.ttft_s < exchange.e2e_s
    second = recorded[1].usage_in_chat_terms()
    assert second.prompt_tokens == finals[1].usage.input_tokens
    assert second.prompt_tokens_details.cached_tokens == finals[1].usage.input_tokens_details.cached_tokens > 0


def test_an_anthropic_stream_and_a_whole_answer_are_recorded(server):
    with recording_proxy(server) as (url, proxy):
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        with client.messages.stream(model="tiny", max_tokens=4,
                                    messages=[{"role": "user", "content": PROMPT}]) as stream:
            streamed = stream.get_final_message()
        whole = client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": PROMPT}])
        recorded = proxy.snapshot()
    assert [(e.path, e.status, e.streamed) for e in recorded] == [("/v1/messages", 200, True),
                                                                   ("/v1/messages", 200, False)]
    assert all(e.request_headers["anthropic-version"] and "k" in e.request_headers["authorization"] for e in recorded)
    # the stream's usage folds message_start's (the prompt) with message_delta's (the output), as the SDK does
    for exchange, message in zip(recorded, (streamed, whole)):
        usage = exchange.usage()
        assert (usage["input_tokens"], usage["output_tokens"], usage["cache_read_input_tokens"]) == (
            message.usage.input_tokens, message.usage.output_tokens, message.usage.cache_read_input_tokens)
    # the stream is timed at its first text delta, the whole answer at its end (when the client has its text)
    assert 0 < recorded[0].ttft_s < recorded[0].e2e_s
    assert recorded[1].ttft_s == recorded[1].e2e_s > 0
    terms = recorded[1].usage_in_chat_terms()
    assert terms.prompt_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert terms.prompt_tokens_details.cached_tokens == whole.usage.cache_read_input_tokens > 0


def test_errors_are_passed_through_and_recorded(server):
    with recording_proxy(server) as (url, proxy):
        refused = httpx.post(url + "/v1/chat/completions?x=1", json={"model": "tiny", "messages": "not a list"})
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
        (exchange,) = proxy.snapshot()
    assert (exchange.path, exchange.status, exchange.usage()) == ("/v1/chat/completions?x=1", 400, None)
    assert exchange.response_body == refused.content
    with recording_proxy("http://127.0.0.1:9") as (url, proxy):  # nothing listens on the discard port
        assert httpx.get(url + "/v1/models").status_code == 502
        (exchange,) = proxy.snapshot()
    assert exchange.status is None and b"unreachable" in exchange.response_body


def test_a_client_that_leaves_mid_stream_is_gone_for_the_server_too(server):
    """The proxy stops reading the server's stream when its client leaves and closes the upstream connection,
    so the server aborts the request and frees its blocks (as tests/api/test_disconnects.py checks without a
    proxy) instead of generating the whole answer for no one."""
    before = wait_idle(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with recording_proxy(server) as (url, proxy):
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert [next(lines) for _ in range(3)][0].startswith("data: ")
                assert metric(scrape(server), "kvreuse_requests_running") == 1
        after = wait_idle(server)  # leaving the block closed the connection mid-stream
        recorded = proxy.snapshot()
    assert metric(after, "kvreuse_requests_total", finish_reason="abort") - \
        metric(before, "kvreuse_requests_total", finish_reason="abort") == 1
    assert metric(after, "kvreuse_generation_tokens_total") - metric(before, "kvreuse_generation_tokens_total") < 4000
    assert metric(after, "kvreuse_kv_blocks", state="in_use") == 0
    assert len(recorded) == 1 and recorded[0].status == 200 and b"[DONE]" not in recorded[0].response_body
