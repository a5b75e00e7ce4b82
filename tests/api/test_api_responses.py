"""OpenAI's Responses API with the official `openai` SDK (and the OpenAI Agents SDK) against a real server on
the tiny checkpoint: create, stream, retrieve and delete; a tool round trip; stored conversations continued
from the exact token ids of their earlier turns (a five-turn chain whose cached_tokens covers every earlier
prompt and answer, and the chain continued on a second replica through a real redis-server); response ids
that belong to their tenant; malformed input as 400s."""
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from redis_server import redis_server
from server_process import running_server
from test_tool_calls import WEATHER

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
ALPHA, BETA = "responses-alpha", "responses-beta"
ARGS = ("--block-size", "4", "--num-gpu-blocks", "2048", "--max-model-len", "4096")
TOOL = {"type": "function", **WEATHER["function"]}
QUESTION = "What is the weather in Paris for the next days?"


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("responses-server") / "server.log"
    with running_server(tiny_llama_path, log_path, *ARGS, "--api-key", ALPHA, "--api-key", BETA) as url:
        yield url


def client_for(url: str, key: str = ALPHA) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


def test_create_stream_retrieve_delete(client):
    first = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=16,
                                    temperature=0, metadata={"step": "1"}, user="u1")
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output[0].type == "message" and first.output_text and first.metadata == {"step": "1"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens >= 1
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens" and first.usage.output_tokens == 16

    with client.responses.stream(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=16,
                                 temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    # the SDK's helper assembles a completed response; one cut by max_output_tokens ends with
    # response.incomplete, as OpenAI streams it, and carries the response itself
    streamed = stream.get_final_response() if first.status == "completed" else events[-1].response
    assert streamed.output_text == first.output_text and streamed.status == first.status
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" if first.status == "completed" else "response.incomplete"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_item.done"} <= set(kinds)
    # the same prompt again: all of it but the last token's block came from the cache
    assert streamed.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_raw_stream_numbers_every_event(server):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", server + "/v1/responses", json=body, headers={"Authorization": f"Bearer {ALPHA}"},
                      timeout=60) as r:
        frames = [f for f in r.read().decode().split("\n\n") if f]
    events = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(f.split("\n")[0] == f"event: {e['type']}" for f, e in zip(frames, events))


def test_store_false_is_not_kept(client):
    answer = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    assert answer.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)


def function_calls(response):
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_continues_the_stored_tokens(client, stream):
    kw = dict(model=MODEL, input=QUESTION, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=200, temperature=0)
    if stream:
        with client.responses.stream(**kw) as s:
            first = s.get_final_response()
    else:
        first = client.responses.create(**kw)
    (call,) = function_calls(first)
    assert first.status == "completed" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    assert client.responses.retrieve(first.id).output[-1].call_id == call.call_id

    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 degrees."}])
    # the stored prompt and answer, token for token, to the answer's last token (never run through the model)
    earlier = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > earlier
    assert second.usage.input_tokens_details.cached_tokens >= earlier - 1

    # stateless, as Codex sends it: the whole history as items, nothing stored
    items = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}]
    stateless = client.responses.create(model=MODEL, input=items, tools=[TOOL], max_output_tokens=4, store=False)
    assert stateless.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_five_turn_chain_reuses_every_earlier_prompt_and_answer(client):
    previous, turns = None, []
    for step in range(5):
        response = client.responses.create(model=MODEL, input=f"Turn {step}: tell me more about Paris.",
                                           instructions="You are a guide.", previous_response_id=previous,
                                           max_output_tokens=12, temperature=0)
        turns.append(response)
        previous = response.id
    for before, after in zip(turns, turns[1:]):
        earlier = before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens > earlier
        assert after.usage.input_tokens_details.cached_tokens >= earlier - 1, (before.usage, after.usage)
    assert [t.previous_response_id for t in turns] == [None] + [t.id for t in turns[:-1]]


def test_changed_instructions_render_the_history_again(client):
    first = client.responses.create(model=MODEL, input="Hello there.", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model=MODEL, input="And then?", instructions="Be verbose.",
                                     previous_response_id=first.id, max_output_tokens=2)
    # the new instructions lead the prompt: only what precedes them is reused
    assert second.usage.input_tokens_details.cached_tokens < first.usage.input_tokens - 4
    assert second.usage.input_tokens > first.usage.input_tokens


def test_another_tenants_response_is_not_found(server, client):
    mine = client.responses.create(model=MODEL, input="A secret.", max_output_tokens=2)
    other = client_for(server, BETA)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="Go on.", previous_response_id=mine.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id


@pytest.mark.parametrize("body, words", [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "'input_image'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "nothing to answer"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "output"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"input": [{"role": "assistant", "content": None, "type": "function_call", "call_id": "c", "name": "f",
                 "arguments": "not json"}, {"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "not valid JSON"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
     "holds functions"),
    ({"input": "hi", "tools": [{"name": "f"}]}, "needs its 'type'"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "allowed_tools"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "nope"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
])
def test_malformed_requests_are_400(server, body, words):
    response = httpx.post(server + "/v1/responses", json={"model": MODEL, **body},
                          headers={"Authorization": f"Bearer {ALPHA}"}, timeout=60)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"], response.json()


def test_harmless_options_are_accepted(client):
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, include=["reasoning.encrypted_content"],
                                     truncation="auto", service_tier="auto", safety_identifier="s",
                                     reasoning={"effort": "low"}, prompt_cache_key="k",
                                     text={"verbosity": "low"})
    assert answer.status in ("completed", "incomplete")


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"],
              "additionalProperties": False}
    answer = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=60, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "c", "schema": schema,
                                                      "strict": True}})
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)


def test_the_agents_sdk_runs_a_tool_loop(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:  # an enum: the random model cannot ramble
        """Weather in a city."""
        calls.append(city)
        return "Sunny."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(
        base_url=server + "/v1", api_key=ALPHA, max_retries=0, timeout=120))
    def after_two_calls(context, results) -> agents.ToolsToFinalOutputResult:
        return agents.ToolsToFinalOutputResult(is_final_output=len(calls) >= 2, final_output=results[-1].output)

    # tool_choice stays "required" (reset_tool_choice off), so each step is a call the grammar keeps short
    agent = agents.Agent(name="guide", instructions="Use the tools.", model=model, tools=[get_weather],
                         tool_use_behavior=after_two_calls, reset_tool_choice=False,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0,
                                                             parallel_tool_calls=False))
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=4)
    assert len(calls) == 2 and result.final_output == "Sunny."
    assert [r.output[0].type for r in result.raw_responses] == ["function_call", "function_call"]
    # the SDK sends the whole history each step (no previous_response_id): the prefix cache reuses it
    assert result.raw_responses[1].usage.input_tokens_details.cached_tokens >= \
        result.raw_responses[0].usage.input_tokens


def test_the_chain_continues_on_a_second_replica_through_redis(tiny_llama_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses-redis")
    with redis_server() as redis, \
            running_server(tiny_llama_path, folder / "a.log", *ARGS, "--redis-url", redis.url) as a, \
            running_server(tiny_llama_path, folder / "b.log", *ARGS, "--redis-url", redis.url) as b:
        first = client_for(a).responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
        assert 0 < redis.client().ttl(f"kvreuse:response:-:{first.id}") <= 24 * 3600
        on_b = client_for(b).responses.create(model=MODEL, previous_response_id=first.id, input="And tomorrow?",
                                              max_output_tokens=2)
        # the same continuation on the replica that made the first turn: the same prompt, token for token
        on_a = client_for(a).responses.create(model=MODEL, previous_response_id=first.id, input="And tomorrow?",
                                              max_output_tokens=2)
        assert on_b.usage.input_tokens == on_a.usage.input_tokens > first.usage.input_tokens
        assert on_b.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4  # blocks via Redis
        assert client_for(b).responses.retrieve(first.id).output_text == first.output_text
