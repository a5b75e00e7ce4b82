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
NAMED_EVENTS = {"/v1/messages", "/v1/responses"}
CHUNK_MODELS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionChunk}


def sse_events_are_chunks_then_done(ctx, response, case) -> None:
    """What the schema can only say in words about a stream: every event is a chunk of the route's shape, an
    error may come last before [DONE], and [DONE] ends it."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    frames = response.content.decode().split("\n\n")
    if case.operation.path in NAMED_EVENTS:  # event: NAME / data: JSON whose type is NAME; no [DONE]
        assert frames[-1] == "" and all(f.startswith("event: ") for f in frames[:-1]), frames[-3:]
        for frame in frames[:-1]:
            name, data = frame.split("\n")
            assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
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
        yield schemathesis.openapi.from_url(url + "/openapi.json")


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
