"""Codex CLI's requests on the Responses door, against a real server on the tiny checkpoint. The requests are
written here in the shape Codex 0.171 sends (captured from `codex exec` against a logging server; its text is
not copied): function tools, a `namespace` tool, hosted tools (web_search, a custom grammar tool),
developer messages, reasoning items and hosted tools' calls sent back, and the fields it always sets
(include, reasoning, store: false, prompt_cache_key, client_metadata, text.verbosity, stream).
What is checked is what Codex acts on: the stream ends with response.completed; a namespaced call comes back as
a function_call with `namespace` and the inner `name` (codex-rs dispatches on that pair); that call sent back
is rendered as the model wrote it; a prompt longer than the context fails with `context_length_exceeded` in a
response.failed event."""
import json
import re

import httpx
import jsonschema
import pytest

from server_process import metric, running_server, wait_idle

pytestmark = pytest.mark.server  # starts a server subprocess

MODEL = "tiny"
ARGS = ("--block-size", "4", "--num-gpu-blocks", "2048", "--max-model-len", "4096")
CLOSE_AGENT = {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
               "parameters": {"type": "object", "properties": {"target": {"type": "string", "enum": ["a1", "a2"]}},
                              "required": ["target"], "additionalProperties": False}}
TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                    "additionalProperties": False}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
     "tools": [CLOSE_AGENT, {"type": "function", "name": "wait_agent", "strict": False,
                             "parameters": {"type": "object", "properties": {}}}]},
    {"type": "custom", "name": "apply_patch", "description": "Patch files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"x\""}},
    {"type": "web_search", "external_web_access": False},
]
SKIPPED = [{"type": "custom", "name": "apply_patch"}, {"type": "web_search"}]


def codex_request(input_items: list, **fields) -> dict:
    """A request with every field Codex sets on each turn."""
    return {"model": MODEL, "stream": True, "input": input_items, "tools": TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-session",
            "client_metadata": {"session_id": "0199-session", "turn_id": "0199-turn"},
            "text": {"verbosity": "low"}, **fields}


def text(role: str, *parts: str, kind: str = "input_text") -> dict:
    return {"type": "message", "role": role, "content": [{"type": kind, "text": p} for p in parts]}


FIRST_TURN = [text("developer", "You are a coding agent. Be brief."),
              text("developer", "<permissions>read-only</permissions>", "<skills>none</skills>"),
              text("user", "<environment_context><cwd>/tmp</cwd></environment_context>"),
              text("user", "Close agent a1.")]


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("codex-server") / "server.log"
    with running_server(tiny_llama_path, log_path, *ARGS) as url:
        yield url, log_path


def stream(url: str, body: dict) -> tuple[int, list[dict]]:
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
        raw = r.read().decode()
    if r.status_code != 200:
        return r.status_code, [json.loads(raw)]
    frames = [f for f in raw.split("\n\n") if f]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return r.status_code, events


def forced_namespaced_call(url: str) -> tuple[dict, list[dict]]:
    body = codex_request(FIRST_TURN, tool_choice={"type": "function", "namespace": "multi_agent_v1",
                                                  "name": "close_agent"}, temperature=0)
    status, events = stream(url, body)
    assert status == 200, events
    return events[-1]["response"], events


def test_a_codex_request_streams_a_namespaced_call_codex_dispatches(server):
    url, log_path = server
    response, events = forced_namespaced_call(url)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    # the pair codex-rs builds its ToolName from: a flat "multi_agent_v1__close_agent" is an unsupported call
    assert call["namespace"] == "multi_agent_v1" and call["name"] == "close_agent"
    jsonschema.validate(json.loads(call["arguments"]), CLOSE_AGENT["parameters"])
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and
            e["item"]["type"] == "function_call"]
    assert done == [call]  # Codex takes the call from output_item.done
    # hosted tools left out, reported, and echoed as sent; one warning for the request
    assert response["skipped_tools"] == SKIPPED and response["tools"][3]["external_web_access"] is False
    assert response["store"] is False
    warnings = re.findall(rf"response {response['id']}: left out tools[^\n]*", log_path.read_text())
    assert len(warnings) == 1 and "apply_patch" in warnings[0] and "web_search" in warnings[0]


def test_the_call_sent_back_renders_as_the_model_wrote_it(server):
    """Codex sends the whole history back: reasoning items, the namespaced call with its output, a hosted
    tool's call. The prompt is the first prompt, then the first answer's own tokens: the call rendered under
    the flat name the model wrote, so the cache covers all of it."""
    url, _ = server
    first, _ = forced_namespaced_call(url)
    (call,) = first["output"]
    sent_back = {k: call[k] for k in ("type", "id", "status", "name", "namespace", "arguments", "call_id")}
    history = [*FIRST_TURN,
               {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}],
                "content": None, "encrypted_content": "gAAAA-opaque"},
               sent_back,
               {"type": "function_call_output", "call_id": call["call_id"], "output": "closed a1"},
               {"type": "web_search_call", "id": "ws_1", "status": "completed",
                "action": {"type": "search", "query": "agents"}},
               {"type": "custom_tool_call", "call_id": "c9", "name": "apply_patch", "input": "*** Begin Patch"},
               {"type": "custom_tool_call_output", "call_id": "c9", "output": "done"},
               {**text("assistant", "Closed.", kind="output_text"), "status": "completed"},
               text("user", "Thanks.")]
    status, events = stream(url, codex_request(history, max_output_tokens=2))
    assert status == 200 and events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    usage = events[-1]["response"]["usage"]
    earlier = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] >= earlier - 4  # all but the last block's tokens

    # the same prompt as chat renders it from the flat name (what the model saw), the dropped items left out
    chat = {"model": MODEL, "messages": [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "<permissions>read-only</permissions>"},
                                       {"type": "text", "text": "<skills>none</skills>"}]},
        {"role": "user", "content": [{"type": "text", "text": "<environment_context><cwd>/tmp</cwd>"
                                                              "</environment_context>"}]},
        {"role": "user", "content": [{"type": "text", "text": "Close agent a1."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["call_id"], "type": "function",
             "function": {"name": "multi_agent_v1__close_agent", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "closed a1"},
        {"role": "assistant", "content": [{"type": "text", "text": "Closed."}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}],
        "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in (TOOLS[0], {**CLOSE_AGENT, "name": "multi_agent_v1__close_agent"},
                            {**TOOLS[1]["tools"][1], "name": "multi_agent_v1__wait_agent"})]}
    rendered = httpx.post(url + "/v1/chat/completions/render", json=chat, timeout=60).json()
    assert len(rendered["token_ids"]) == usage["input_tokens"]


def test_a_tool_choice_of_a_hosted_tool_is_auto(server):
    url, log_path = server
    status, events = stream(url, codex_request(FIRST_TURN, tool_choice={"type": "web_search"},
                                               max_output_tokens=2))
    response = events[-1]["response"]
    assert status == 200 and response["status"] in ("completed", "incomplete")
    assert response["tool_choice"]["type"] == "web_search" and response["skipped_tools"] == SKIPPED
    warnings = re.findall(rf"response {response['id']}: left out tools[^\n]*", log_path.read_text())
    assert len(warnings) == 1 and "tool_choice {'type': 'web_search'} taken as 'auto'" in warnings[0]


def test_a_prompt_longer_than_the_context_fails_as_codex_reads_it(server):
    url, _ = server
    too_long = [*FIRST_TURN, text("user", "lorem ipsum " * 600)]
    status, events = stream(url, codex_request(too_long))
    # streamed: created, then response.failed with the code (codex-api's sse/responses.rs maps it to
    # ContextWindowExceeded); a 200, since the stream had begun as far as the client knows
    assert status == 200 and [e["type"] for e in events] == ["response.created", "response.in_progress",
                                                             "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in failed["error"]["message"] and failed["output"] == []

    status, (body,) = stream(url, codex_request(too_long, stream=False))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error"
    assert metric(wait_idle(url), "kvreuse_kv_blocks", state="in_use") == 0
