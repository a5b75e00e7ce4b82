"""Claude Code's requests on the Messages door, against a real server (tiny checkpoint): a request written in
the shape Claude Code 2.1.197 sends (system messages inside `messages`, three system blocks led by its billing
header, tools with JSON-schema keywords and Anthropic's tool fields, a server tool, `thinking`, `output_config`,
`context_management`, `metadata.user_id`, the `?beta=true` query and the beta headers), the billing header
left out of the prompt, the fields Anthropic documents accepted, and the context overflow worded as Claude
Code reads it. The texts are ours, in Claude Code's shape; none is Anthropic's prompt."""
import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from server_process import running_server, wait_idle, metric

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
BLOCK = 4
CONTEXT = 2048
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "thinking-token-count-2026-05-13",
         "context-management-2025-06-27", "prompt-caching-scope-2026-01-05", "mid-conversation-system-2026-04-07",
         "effort-2025-11-24"]
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": ",".join(BETAS), "x-app": "cli",
           "X-Claude-Code-Session-Id": "0b7e4c4e-6f1d-4c55-9a51-5d0c1b2a9f10",
           "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)"}
# Claude Code's first system block: metadata for Anthropic's billing, its suffix different every session.
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;"
# Tools using the schema keywords Claude Code's (zod-made) schemas use.
SHELL = {"name": "Shell", "description": "Runs a command.", "input_schema": {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
    "properties": {"command": {"type": "string", "pattern": "^[a-z]"},
                   "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 600000},
                   "url": {"type": "string", "format": "uri"}},
    "required": ["command"], "additionalProperties": False}}
TASKS = {"type": "custom", "name": "TaskUpdate", "description": "Updates a task.",
         "cache_control": {"type": "ephemeral"}, "strict": True, "defer_loading": False,
         "eager_input_streaming": True, "input_examples": [{"taskId": "1", "status": "deleted"}],
         "input_schema": {
             "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
             "properties": {"taskId": {"type": "string"},
                            "status": {"anyOf": [{"type": "string", "enum": ["pending", "completed"]},
                                                 {"type": "string", "const": "deleted"}]},
                            "metadata": {"type": "object", "propertyNames": {"type": "string"},
                                         "additionalProperties": {}}},
             "required": ["taskId"], "additionalProperties": False}}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}



def prompt_tokens(usage: dict) -> int:
    """The whole prompt, as Anthropic splits it: computed, read from the cache, and written at breakpoints."""
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]

def system_blocks(suffix: str, instructions: str) -> list[dict]:
    return [{"type": "text", "text": BILLING.format(suffix)},
            {"type": "text", "text": "You are an agent for tests.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": instructions, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]


def claude_code_body(suffix: str, question: str, instructions: str = "Answer in one short line.") -> dict:
    """A first request as Claude Code writes one: the question after a reminder block, then a system message
    (the agent list Claude Code sends mid-conversation)."""
    return {
        "model": MODEL, "max_tokens": 8, "stream": True, "temperature": 0,
        "system": system_blocks(suffix, instructions),
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Today is Friday.</system-reminder>"},
                {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types: general, explorer."}],
        "tools": [SHELL, TASKS, WEB_SEARCH],
        "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "",
                                            "session_id": HEADERS["X-Claude-Code-Session-Id"]})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


@pytest.fixture(scope="module")
def server_and_log(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("claude-code-server") / "server.log"
    with running_server(tiny_llama_path, log_path, "--block-size", str(BLOCK), "--num-gpu-blocks", "1024",
                        "--max-model-len", str(CONTEXT)) as url:
        yield url, log_path


@pytest.fixture(scope="module")
def server(server_and_log):
    return server_and_log[0]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def post(server: str, body: dict, path: str = "/v1/messages?beta=true") -> httpx.Response:
    return httpx.post(server + path, json=body, headers=HEADERS, timeout=120)


def count(server: str, body: dict) -> int:
    body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
    response = post(server, body, "/v1/messages/count_tokens?beta=true")
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for frame in filter(None, response.text.split("\n\n")):
        name, data = frame.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_claude_code_request_streams_a_whole_answer(server_and_log):
    server, log_path = server_and_log
    body = claude_code_body("476", "What does the Shell tool do?")
    response = post(server, body)
    assert response.status_code == 200, response.text
    stream = events(response)
    names = [name for name, _ in stream]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    assert all(data["type"] == name for name, data in stream)
    assert names.count("content_block_start") == names.count("content_block_stop")
    delta = stream[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert prompt_tokens(delta["usage"]) == count(server, body)
    # the server tool is left out of the prompt and said so, not refused
    assert "left server tool(s) web_search out of the prompt" in log_path.read_text()


def test_system_messages_are_rendered_where_they_are_sent(server):
    """The Messages prompt is the chat prompt of the same conversation with the system message at its place
    (and without the billing header): after that chat request, the Messages request reads all of it from the
    cache. A system message moved to the front, or the header rendered, would leave the cached prefix early."""
    body = claude_code_body("a01", "Which tool updates a task?", "Placement check: instructions one.")
    chat = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": [{"type": "text", "text": b["text"]} for b in body["system"][1:]]},
        {"role": "user", "content": [{"type": "text", "text": b["text"]} for b in body["messages"][0]["content"]]},
        {"role": "system", "content": [{"type": "text", "text": body["messages"][1]["content"]}]}],
        "tools": [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in (SHELL, TASKS)]}
    rendered = httpx.post(server + "/v1/chat/completions/render", json=chat, timeout=60).json()["token_ids"]
    assert httpx.post(server + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
    response = post(server, {**body, "stream": False, "max_tokens": 1})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert prompt_tokens(usage) == len(rendered)
    assert usage["cache_read_input_tokens"] >= len(rendered) - BLOCK


def test_the_billing_header_does_not_change_the_prompt(server):
    """Two sessions' first requests differ only in the header's suffix: the same tokens, the second read from
    the first's cache, and the same count as with no header block at all."""
    first = claude_code_body("476", "Header check: list the tools.", "Header check: instructions two.")
    second = claude_code_body("e77", "Header check: list the tools.", "Header check: instructions two.")
    without = {**first, "system": first["system"][1:]}
    counted = count(server, first)
    assert count(server, second) == counted == count(server, without)
    one = post(server, {**first, "stream": False, "max_tokens": 1}).json()["usage"]
    assert prompt_tokens(one) == counted
    two = post(server, {**second, "stream": False, "max_tokens": 1}).json()["usage"]
    assert prompt_tokens(two) == counted
    assert two["cache_read_input_tokens"] >= counted - BLOCK


def test_a_system_message_cleared_at_the_next_user_message(server):
    question = [{"role": "user", "content": "Clear check: hello."}]
    note = {"role": "system", "content": "Clear check: a note for this turn only.", "clear_at": "next_user_message"}
    plain = {k: v for k, v in note.items() if k != "clear_at"}
    follow = [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Clear check: again."}]
    def tokens(messages: list[dict]) -> int:
        return count(server, {"model": MODEL, "messages": messages})

    assert tokens(question + [note]) == tokens(question + [plain])  # shown in the turn it follows
    assert tokens(question + [note] + follow) == tokens(question + follow)  # gone once a user message follows
    assert tokens(question + [plain] + follow) > tokens(question + follow)


HISTORY = [{"role": "user", "content": "History check: search the web for the capital of Peru."},
           {"role": "assistant", "content": [
               {"type": "thinking", "thinking": "The user wants a search.", "signature": "c2ln"},
               {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
               {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                "input": {"query": "capital of Peru"}},
               {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
                   {"type": "web_search_result", "url": "https://example.org/peru", "title": "Peru",
                    "encrypted_content": "ZW5j"}]},
               {"type": "text", "text": "Lima is the capital of Peru.", "citations": [
                   {"type": "web_search_result_location", "url": "https://example.org/peru", "title": "Peru",
                    "encrypted_index": "aW5k", "cited_text": "Lima is the capital"}]}]},
           {"role": "user", "content": "History check: and of Chile?"}]


def test_blocks_of_an_earlier_answer_this_server_does_not_render_are_left_out(server):
    text_only = [HISTORY[0], {"role": "assistant", "content": "Lima is the capital of Peru."}, HISTORY[2]]
    assert count(server, {"model": MODEL, "messages": HISTORY}) == \
        count(server, {"model": MODEL, "messages": text_only})
    response = post(server, {"model": MODEL, "max_tokens": 2, "messages": HISTORY})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("extra", [
    {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    {"thinking": {"type": "disabled"}},
    {"thinking": {"type": "adaptive", "display": "omitted"}},
    {"output_config": {"effort": "low"}},
    {"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                                                        "value": 30000}}]}},
    {"cache_control": {"type": "ephemeral", "ttl": "5m"}},
    {"metadata": {"user_id": "user-1"}},
    {"service_tier": "auto", "speed": "standard", "inference_geo": "us"},
    {"tools": [{"type": "bash_20250124", "name": "bash"}, {"type": "text_editor_20250728",
                                                            "name": "str_replace_based_edit_tool"},
               {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2}, SHELL]},
], ids=lambda extra: ",".join(extra))
def test_documented_fields_are_accepted_on_both_routes(server, extra):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Fields check."}], **extra}
    response = post(server, body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert prompt_tokens(usage) == count(server, body)


def test_output_config_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
              "required": ["city"], "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=60, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "Format check: pick a city."}],
                                     output_config={"effort": "medium", "format": {"type": "json_schema",
                                                                                   "schema": schema}})
    assert message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads("".join(b.text for b in message.content if b.type == "text")), schema)


def test_the_sdk_beta_client_sends_what_claude_code_sends(client):
    """The anthropic SDK's beta client (Claude Code's own SDK, in Python): `?beta=true`, the betas header,
    a system message in `messages`, context_management."""
    with client.beta.messages.stream(
            model=MODEL, max_tokens=4, betas=BETAS, system=system_blocks("5a1", "SDK check."),
            messages=[{"role": "user", "content": "SDK check: hello."},
                      {"role": "system", "content": [{"type": "text", "text": "SDK check: a mid-conversation note."}]}],
            thinking={"type": "adaptive"}, output_config={"effort": "high"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            metadata={"user_id": "u"}, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1


# Claude Code 2.1.197 reads this message with this expression (from its bundle) and compacts the conversation.
# (A max_tokens past the room left is fitted to it: tests/api/test_agent_names_and_limits.py.)
PROMPT_TOO_LONG = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_prompt_is_too_long(server, stream):
    body = {"model": MODEL, "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": "Overflow check: " + "many words here " * 400}]}
    prompt = count(server, body)
    assert prompt >= CONTEXT
    response = post(server, body)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert response.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"prompt is too long: {prompt} tokens > {CONTEXT - 1} maximum"}}
    assert PROMPT_TOO_LONG.search(response.json()["error"]["message"]).groups() == (str(prompt), str(CONTEXT - 1))
    m = wait_idle(server)
    assert metric(m, "kvreuse_kv_blocks", state="in_use") == 0


def test_the_openai_routes_keep_openais_wording(server):
    chat = {"model": MODEL, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Overflow check: " + "many words here " * 400}]}
    error = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).json()["error"]
    assert error["code"] == "context_length_exceeded" and "maximum context length is" in error["message"]
