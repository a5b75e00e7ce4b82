"""schemathesis against the server's own OpenAPI schema (/openapi.json), on a real server with the tiny
checkpoint: a few hundred generated requests, valid and invalid, across every route. No response may be a
5xx, and every response must be one the schema declares for that route (status, content type, headers,
body). Hypothesis prints how to reproduce a failing case (its seed).

(schemathesis's pytest plugin cannot resolve a fixture under this pytest, so each route's strategy is drawn
with hypothesis directly.)"""
import json
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.core.transport import DEFAULT_MAX_STREAM_EVENTS
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

from reuse_server.api.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse
from server_process import running_server

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

ROUTES = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/cache/chunks"), ("POST", "/v1/cache/prefetch"),
          ("GET", "/v1/cache/stats"), ("GET", "/server_info"), ("GET", "/model_info"), ("GET", "/get_load"),
          ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
          ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
          ("POST", "/v1/completions/render"), ("POST", "/v1/chat/completions/render")]
CASES = {"POST": 80, "GET": 15, "DELETE": 15}  # per route, about half of them schema-invalid
# Each named-event dialect's last event: Anthropic's message_stop, the Responses API's completed or incomplete
# response (or failed: a prompt longer than the context); an error event may end either instead.
LAST_EVENTS = {"/v1/messages": {"message_stop", "error"},
               "/v1/responses": {"response.completed", "response.incomplete", "response.failed", "error"}}
# schemathesis stops reading a stream after 20 events by default and closes it; the checks below need
# every stream whole. The longest here: 16 choices of at most 96 tokens, an event a token, a few more a choice.
MAX_STREAM_EVENTS = 10_000
CHUNK_MODELS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionChunk}


def sse_events_are_chunks_then_done(ctx, response, case) -> None:
    """What the schema can only say in words about a stream, read whole: every event is a chunk of the route's
    shape, an error may come last before [DONE], and [DONE] ends it; the named-event dialects end with their own
    last event."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    assert not response.stream_cut_short, "the client stopped reading this stream (MAX_STREAM_EVENTS, timeout)"
    frames = response.content.decode().split("\n\n")
    if case.operation.path in LAST_EVENTS:  # event: NAME / data: JSON whose type is NAME; no [DONE]
        assert frames[-1] == "" and all(f.startswith("event: ") for f in frames[:-1]), frames[-3:]
        names = []
        for frame in frames[:-1]:
            name, data = frame.split("\n")
            names.append(name.removeprefix("event: "))
            assert json.loads(data.removeprefix("data: "))["type"] == names[-1]
        assert names[-1] in LAST_EVENTS[case.operation.path], names[-3:]
        return
    assert frames[-1] == "" and frames[-2] == "data: [DONE]", frames[-3:]
    events = [frame.removeprefix("data: ") for frame in frames[:-2]]
    assert all(frame.startswith("data: ") for frame in frames[:-1])
    for i, event in enumerate(events):
        if i == len(events) - 1 and '"error"' in event and "error" in json.loads(event):
            ErrorResponse.model_validate_json(event)
        else:
            CHUNK_MODELS[case.operation.path].model_validate_json(event)


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, sse_events_are_chunks_then_done]


@pytest.fixture(scope="module")
def api_schema(tiny_llama_path, tmp_path_factory):
    # A short context keeps every generated request short; the timeout bounds any that is not.
    log_path = tmp_path_factory.mktemp("fuzz") / "server.log"
    with running_server(tiny_llama_path, log_path, "--block-size", "4", "--num-gpu-blocks", "512",
                        "--max-model-len", "96", "--request-timeout", "10") as url:
        yield schemathesis.openapi.from_url(url + "/openapi.json", config=SchemathesisConfig.from_dict(
            {"max-stream-events": MAX_STREAM_EVENTS}))


def test_the_routes_fuzzed_are_all_the_routes(api_schema):
    declared = {(method.upper(), path) for path, methods in api_schema.raw_schema["paths"].items()
                for method in methods}
    assert declared == set(ROUTES)


@pytest.mark.parametrize("method, path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_response_is_declared_and_none_is_a_5xx(api_schema, method, path):
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    statuses = {}

    @given(case=cases)
    @settings(max_examples=CASES[method], deadline=None, phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        response = case.call_and_validate(checks=CHECKS, timeout=30)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    started = time.monotonic()
    check()
    print(f"{method} {path}: {sum(statuses.values())} cases in {time.monotonic() - started:.1f} s, "
          f"statuses {dict(sorted(statuses.items()))}")
    assert not any(status >= 500 for status in statuses)


# A valid streaming request a streaming route, longer than schemathesis's default of 20 events where the route
# takes ignore_eos: the fuzzed cases reach a whole stream only by chance.
STREAMS = {
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "n": 2, "stream": True,
                        "stream_options": {"include_usage": True}},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40,
                             "ignore_eos": True, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
    "/v1/messages": {"model": "tiny", "max_tokens": 40, "messages": [{"role": "user", "content": "Tell me a story."}],
                     "stream": True},
    "/v1/responses": {"input": "Tell me a story.", "max_output_tokens": 40, "stream": True},
}


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_whole_stream_passes_the_stream_check(api_schema, path):
    response = api_schema[path]["POST"].Case(body=STREAMS[path]).call_and_validate(checks=CHECKS, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
    if path in CHUNK_MODELS:  # past the events schemathesis reads by default (a token may add no text)
        assert response.content.count(b"\n\ndata: ") > DEFAULT_MAX_STREAM_EVENTS
