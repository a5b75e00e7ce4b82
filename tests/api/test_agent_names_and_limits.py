"""What coding agents trip over on every door, against real servers (tiny checkpoint) through the official
`openai` and `anthropic` SDKs: the model names a request may give (`--served-model-name a b`, the `--model`
alias; an unknown name is still a 404), an output limit beyond the context (Claude Code's max_tokens 32,000)
capped at the room left and ending with the door's length stop reason, and `--max-tokens` capping answers
that ask for no limit (Codex sends none).

The checkpoint's output head gives its end-of-text token a logit of 0, against the largest of 319 random
logits (positive unless all 319 are negative: odds 2^-319), so a greedy answer never stops by itself and
every answer here runs to its limit: what it ends at is the limit under test, never chance."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from server_process import running_server
from tiny_checkpoint import EOS, write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

ID, OTHER = "tiny", "claude-sonnet-4-5-20250929"  # --served-model-name tiny claude-sonnet-4-5-20250929
CONTEXT = 1024  # --max-model-len: room for the prompts below (tools included) and an answer
SERVER_CAP = 5  # --max-tokens of the second server
USER = [{"role": "user", "content": "Tell me about Paris."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def endless_path(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("endless"), arch="llama")
    weights = load_file(path / "model.safetensors")
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(EOS)
    weights["lm_head.weight"][eos] = 0.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def server(endless_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("names-server") / "server.log"
    with running_server(endless_path, log, "--served-model-name", ID, OTHER, "--block-size", "4",
                        "--num-gpu-blocks", "256", "--max-model-len", str(CONTEXT), "--no-blend-key-shift") as url:
        yield url


@pytest.fixture(scope="module")
def capped(endless_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("capped-server") / "server.log"
    with running_server(endless_path, log, "--max-tokens", str(SERVER_CAP), "--block-size", "4",
                        "--num-gpu-blocks", "256", "--max-model-len", str(CONTEXT), "--no-blend-key-shift") as url:
        yield url


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


# Each door asked once, with the model name and output limit given: (the model the answer reports, its
# stop reason, output tokens, prompt tokens).
def chat(url, model, limit=None, limit_field="max_tokens"):
    kw = {} if limit is None else {limit_field: limit}
    r = openai_client(url).chat.completions.create(model=model, messages=USER, **GREEDY, **kw)
    return r.model, r.choices[0].finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens


def chat_stream(url, model, limit=None):
    kw = {} if limit is None else {"max_tokens": limit}
    stream = openai_client(url).chat.completions.create(model=model, messages=USER, stream=True,
                                                        stream_options={"include_usage": True}, **GREEDY, **kw)
    chunks = list(stream)
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    usage = chunks[-1].usage
    return chunks[0].model, reason, usage.completion_tokens, usage.prompt_tokens


def completion(url, model, limit=None):
    kw = {} if limit is None else {"max_tokens": limit}
    r = openai_client(url).completions.create(model=model, prompt="Paris is", **GREEDY, **kw)
    return r.model, r.choices[0].finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens


def response(url, model, limit=None):
    kw = {} if limit is None else {"max_output_tokens": limit}
    r = openai_client(url).responses.create(model=model, input="Tell me about Paris.", store=False, **GREEDY, **kw)
    reason = r.incomplete_details.reason if r.status == "incomplete" else r.status
    return r.model, reason, r.usage.output_tokens, r.usage.input_tokens


def message(url, model, limit):  # Anthropic's API requires max_tokens
    r = anthropic_client(url).messages.create(model=model, max_tokens=limit, messages=USER, extra_body=GREEDY)
    return r.model, r.stop_reason, r.usage.output_tokens, r.usage.input_tokens + r.usage.cache_read_input_tokens


DOORS = {"chat": chat, "chat-stream": chat_stream, "completions": completion, "responses": response,
         "messages": message}
LENGTH_REASON = {"chat": "length", "chat-stream": "length", "completions": "length",
                 "responses": "max_output_tokens", "messages": "max_tokens"}


@pytest.mark.parametrize("door", DOORS)
def test_every_served_name_and_the_model_alias_are_served_under_the_id(server, endless_path, door):
    for name in (ID, OTHER, str(endless_path)):  # the second served name; the --model value
        model, reason, output, _ = DOORS[door](server, name, 3)
        assert (model, reason, output) == (ID, LENGTH_REASON[door], 3), name


@pytest.mark.parametrize("door", DOORS)
def test_an_unknown_model_is_still_a_404(server, door):
    with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)) as err:
        DOORS[door](server, "claude-opus-4-1", 3)
    assert "claude-opus-4-1" in str(err.value)


@pytest.mark.parametrize("path, body", [
    ("/v1/messages/count_tokens", {"messages": USER}),
    ("/v1/chat/completions/render", {"messages": USER}),
    ("/v1/completions/render", {"prompt": "Paris is"}),
    ("/v1/cache/prefetch", {"prompt": "Paris is"}),
    ("/v1/cache/chunks", {"chunks": ["Paris is the capital of France."]}),
])
def test_the_other_routes_take_the_same_names(server, endless_path, path, body):
    for name in (ID, OTHER, str(endless_path)):
        r = httpx.post(server + path, json={"model": name, **body}, timeout=60)
        assert r.status_code == 200, (name, r.text)
        reported = r.json()[0] if isinstance(r.json(), list) else r.json()
        assert reported.get("model", ID) == ID
    assert httpx.post(server + path, json={"model": "gpt-4", **body}, timeout=60).status_code == 404


def test_models_lists_the_served_names_as_vllm_does(server, endless_path):
    cards = httpx.get(server + "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [ID, OTHER]  # the --model alias is accepted, not listed
    assert all(c["max_model_len"] == CONTEXT for c in cards)
    # a gateway registers the worker under the id
    assert httpx.get(server + "/server_info").json()["served_model_name"] == ID
    assert httpx.get(server + "/model_info").json()["served_model_name"] == ID


@pytest.mark.parametrize("door, field", [("chat", "max_tokens"), ("chat", "max_completion_tokens"),
                                         ("chat-stream", None), ("completions", None), ("responses", None),
                                         ("messages", None)])
def test_a_limit_beyond_the_context_fills_the_room_left(server, door, field):
    ask = DOORS[door] if field is None else (lambda url, model, limit: chat(url, model, limit, field))
    model, reason, output, prompt = ask(server, ID, 32000)  # what Claude Code sends
    assert reason == LENGTH_REASON[door]
    assert prompt + output == CONTEXT and output > 0


def test_a_prompt_that_does_not_fit_is_still_an_error(server):
    r = httpx.post(server + "/v1/completions", json={"model": ID, "prompt": "Paris is lovely. " * 400,
                                                     "max_tokens": 32000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


@pytest.mark.parametrize("door", ["chat", "chat-stream", "completions", "responses"])
def test_max_tokens_caps_an_answer_that_asks_for_no_limit(capped, door):
    model, reason, output, prompt = DOORS[door](capped, ID, None)
    # Responses: an answer the server's cap ended, on a request that set no limit, is a completed response
    # (Codex, which sends none, fails a turn that ends incomplete); an answer the context cut stays incomplete
    # (test_a_limit_beyond_the_context_fills_the_room_left)
    assert (reason, output) == ("completed" if door == "responses" else LENGTH_REASON[door], SERVER_CAP)
    assert prompt + SERVER_CAP < CONTEXT  # the cap, not the context, ended it


@pytest.mark.parametrize("door", DOORS)
def test_max_tokens_caps_a_larger_limit_and_a_smaller_one_wins(capped, door):
    assert DOORS[door](capped, ID, 1000)[1:3] == (LENGTH_REASON[door], SERVER_CAP)
    assert DOORS[door](capped, ID, 2)[1:3] == (LENGTH_REASON[door], 2)


# A tool with a schema xgrammar refuses (a regex with a Unicode class, as a real client may send), forced.
FREE_TOOL = {"name": "lookup", "description": "Look a word up.", "input_schema": {
    "type": "object", "properties": {"word": {"type": "string", "pattern": "^\\p{L}+$"}}, "required": ["word"]}}


def test_a_tool_whose_schema_xgrammar_refuses_is_still_called(server):
    r = anthropic_client(server).messages.create(model=ID, max_tokens=200, messages=USER, tools=[FREE_TOOL],
                                                 tool_choice={"type": "any"}, extra_body=GREEDY)
    calls = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(calls) >= 1
    assert all(c.name == "lookup" and isinstance(c.input, dict) for c in calls)
