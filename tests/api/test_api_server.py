"""The real server in a subprocess (tiny random checkpoint, loopback port), driven by the official openai
client and raw httpx: responses, streaming, cache reporting, errors and metrics. Client disconnects are in
test_disconnects.py."""
import json
import uuid

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from blend.chunking import encode, render_chat_chunks
from server_process import metric, running_server, scrape, wait_idle

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(tiny_llama_path, log_path, "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", "512",
                        "--max-model-len", str(MAX_MODEL_LEN)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def unique_text(words: int = 60) -> str:
    tag = uuid.uuid4().hex[:8]
    return f"[{tag}] " + " ".join(["The quick brown fox jumps over the lazy dog."] * (words // 9 + 1))


# ---------------------------------------------------------------- happy paths


def test_health_and_models(server):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    listing = httpx.get(server + "/v1/models").json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == [MODEL]


def test_chat_completion(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    # chat prompts are the template's rendering cut into chunks (framing, each content), each tokenized alone
    chunks = render_chat_chunks(tokenizer, messages)
    assert "".join(c.text for c in chunks) == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                            tokenize=False)
    assert resp.usage.prompt_tokens == sum(len(encode(tokenizer, c.text)) for c in chunks)
    assert resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 5


def test_completion_with_text_and_token_prompts(client, tokenizer):
    prompt = "The capital of France is"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.choices[0].finish_reason == "length"
    ids = tokenizer.encode(prompt)
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 4
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == resp.choices[0].text  # greedy: same tokens in, same text out


def test_chat_stream_with_usage_matches_non_stream(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about caches."}], max_tokens=8,
                  temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_raw_sse_framing(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames[:-1])
    first = json.loads(frames[0][len("data: "):])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first  # no include_usage: no usage anywhere


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = unique_text()

    def cached(**extra):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        details = resp.usage.prompt_tokens_details
        return resp.usage.prompt_tokens, details.cached_tokens

    n, first = cached()
    assert n > 4 * BLOCK_SIZE and first == 0
    _, second = cached()
    assert 0 < second < n and second >= n - 2 * BLOCK_SIZE  # all full blocks but the last token's
    assert cached(prefix_cache=False)[1] == 0
    assert cached(cache_salt="tenant-a")[1] == 0  # salted: no sharing with unsalted blocks
    assert cached(cache_salt="tenant-a")[1] == second


def test_several_choices_share_one_prefill(server, client):
    """n=3 sampled choices: three indexed choices, the prompt counted once in usage and computed once (the
    other two choices wait a step and hit it), each choice reproducible from the request's seed."""
    wait_idle(server)
    prompt = unique_text(60)
    before = scrape(server)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    resp = client.completions.create(**kwargs)
    after = scrape(server)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 24 and resp.usage.total_tokens == resp.usage.prompt_tokens + 24
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # the choice that computed the prompt
    assert len({c.text for c in resp.choices}) > 1  # one seed per choice, not the same draw three times
    hits = metric(after, "kvreuse_prefix_cache_hits_total") - metric(before, "kvreuse_prefix_cache_hits_total")
    full_blocks = (resp.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert hits >= 2 * full_blocks
    assert [c.text for c in client.completions.create(**kwargs).choices] == [c.text for c in resp.choices]
    greedy = client.completions.create(**{**kwargs, "temperature": 0, "seed": None})
    assert len({c.text for c in greedy.choices}) == 1


def test_several_choices_stream_interleaved(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three caches."}], max_tokens=6, n=2,
                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    by_index = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        by_index[choice.index].append(choice)
    for i, parts in by_index.items():
        assert parts[0].delta.role == "assistant"
        assert [p.finish_reason for p in parts if p.finish_reason] == ["length"] and parts[-1].finish_reason
        assert "".join(p.delta.content or "" for p in parts) == full.choices[i].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_logit_bias_and_penalties_steer_generation(client, tokenizer):
    """A +100 bias makes greedy decoding emit that token every time; a frequency penalty stops greedy
    decoding from repeating one token forever (the unpenalized run of this random model does repeat)."""
    token = tokenizer.encode(" fox", add_special_tokens=False)[-1]
    forced = client.completions.create(model=MODEL, prompt="The", max_tokens=5, temperature=0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([token] * 5)

    def greedy_ids(**extra):
        resp = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=24, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True, **extra})
        return resp.choices[0].logprobs.tokens

    plain, penalized = greedy_ids(), greedy_ids(frequency_penalty=2.0)
    most_repeated = max(plain.count(t) for t in plain)
    assert most_repeated > 3  # the premise: unpenalized greedy text repeats itself
    assert max(penalized.count(t) for t in penalized) < most_repeated


def test_developer_role_is_the_system_role(client):
    def ask(role):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hello?"}],
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})

    as_system, as_developer = ask("system"), ask("developer")
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content


def test_tools_with_tool_choice_none_are_accepted(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        response_format={"type": "text"})
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_logprobs_shapes(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.logprob  # the best alternative is at least as likely
        assert bytes(tok.bytes).decode() == tok.token
    comp = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_metrics_follow_requests(server, client):
    before = wait_idle(server)
    prompt = unique_text(30)
    usages = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                        extra_body={"ignore_eos": True}).usage for _ in range(2)]
    after = wait_idle(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("kvreuse_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("kvreuse_prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert delta("kvreuse_prefix_cache_hits_total") == sum(cached) and cached[1] == usages[1].prompt_tokens - 1
    assert delta("kvreuse_generation_tokens_total") == 6
    assert delta("kvreuse_requests_total", finish_reason="length") == 2
    assert delta("kvreuse_time_to_first_token_seconds_count") == 2
    assert delta("kvreuse_e2e_request_latency_seconds_count") == 2
    assert metric(after, "kvreuse_kv_blocks_total") == 512
    states = sum(metric(after, "kvreuse_kv_blocks", state=s) for s in ("free", "evictable", "in_use"))
    assert states == 512 and metric(after, "kvreuse_kv_blocks", state="evictable") > 0
    for name in ("kvreuse_blended_tokens_total", "kvreuse_recomputed_tokens_total", "kvreuse_evicted_blocks_total",
                 "kvreuse_requests_waiting", "kvreuse_e2e_request_latency_seconds_bucket"):
        assert any(key[0] == name for key in after), name


# ---------------------------------------------------------------- errors


def _long_ids(n):
    return [5 + i % 200 for i in range(n)]


ERROR_CASES = [
    # (id, path, body (dict, or raw bytes), status, param, code, words that must appear in the message)
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found", ["gpt-4"]),
    ("bad-json", "/v1/completions", b'{"prompt": "x",', 400, None, None, ["JSON"]),
    ("body-not-object", "/v1/chat/completions", b"[1, 2]", 400, None, None, ["request body"]),
    ("missing-prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt", None, ["prompt"]),
    ("batched-prompt", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None, ["2 prompts"]),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", None, ["empty"]),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [1, 10**7]}, 400, "prompt", None, [str(10**7)]),
    ("n-17", "/v1/completions", {"prompt": "x", "n": 17}, 400, "n", None, ["n=17", "16"]),
    ("n-0", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n", None,
     ["n=0"]),
    ("echo", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", None, ["echo"]),
    ("temperature", "/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature", None, ["3"]),
    ("max-tokens-0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None, ["max_tokens"]),
    ("prompt-too-long", "/v1/completions", {"prompt": _long_ids(MAX_MODEL_LEN + 76)}, 400, None, None,
     [str(MAX_MODEL_LEN), str(MAX_MODEL_LEN + 76)]),
    ("prompt-too-long-stream", "/v1/completions", {"prompt": _long_ids(MAX_MODEL_LEN + 5), "stream": True}, 400,
     None, None, [str(MAX_MODEL_LEN), str(MAX_MODEL_LEN + 5)]),
    ("logprobs-range", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None, ["21"]),
    ("blend-unknown-field", "/v1/completions", {"prompt": "x", "kv_blend": {"ratio": 0.1}}, 400, "kv_blend.ratio",
     None, ["kv_blend.ratio"]),
    ("blend-ratio-range", "/v1/completions", {"prompt": "x", "kv_blend": {"recompute_ratio": 1.5}}, 400,
     "kv_blend.recompute_ratio", None, ["recompute_ratio"]),
    ("chat-no-messages", "/v1/chat/completions", {"messages": []}, 400, "messages", None, ["messages"]),
    ("chat-empty-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, 400, "messages[0].content",
     None, ["non-empty"]),
    ("chat-image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content", None, ["image_url"]),
    ("chat-bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", None, ["role"]),
    ("chat-top-logprobs-alone", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs", None, ["logprobs"]),
    ("chat-stream-bad-stop", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"], "stream": True}, 400,
     "stop", None, ["4"]),
    ("chat-too-long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "fox " * 2000}], "max_tokens": 1}, 400, None, None,
     [str(MAX_MODEL_LEN)]),
    ("seed-overflow", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed", None, ["seed"]),
    ("lone-surrogate-prompt", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, None, None, ["prompt", "Unicode"]),
    ("lone-surrogate-salt-stream", "/v1/completions", b'{"prompt": "ab", "stream": true, "cache_salt": "\\udfff"}',
     400, None, None, ["cache_salt", "Unicode"]),
    ("presence-penalty-range", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400,
     "presence_penalty", None, ["2.5"]),
    ("logit-bias-range", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", None,
     ["101"]),
    ("logit-bias-not-a-token", "/v1/completions", {"prompt": "x", "logit_bias": {"fox": 1}}, 400, "logit_bias",
     None, ["fox"]),
    ("logit-bias-outside-vocab", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}, 400, "logit_bias", None,
     ["999999"]),
    ("tool-without-name", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"parameters": {}}}]},
     400, "tools[0].function.name", None, ["tools[0].function.name"]),
    ("tool-bad-name", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     400, "tools[0].function.name", None, ["pattern"]),
    ("tool-not-a-function", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom", "custom": {"name": "f"}}]},
     400, "tools[0].type", None, ["function"]),
    ("tool-parameters-not-an-object", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     400, "tools[0].function.parameters", None, ["'object'"]),
    ("tool-defined-twice", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     400, "tools", None, ["more than once"]),
    ("tool-choice-unknown-function", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", None, ["'g'"]),
    ("tool-choice-required-without-tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice", None,
     ["needs tools"]),
    ("tool-choice-unknown-mode", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, 400, "tool_choice", None,
     ["'required'"]),
    ("tool-choice-without-function", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}}, 400, "tool_choice",
     None, ["'required'"]),
    ("tool-call-arguments-not-json", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "messages", None, ["messages[1].tool_calls[0]", "JSON"]),
    ("tool-calls-on-a-user-message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages[0]", None, ["assistant"]),
    ("response-format-unknown", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format.type", None, ["json_schema"]),
    ("json-schema-missing", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, 400,
     "response_format", None, ["json_schema"]),
    ("json-schema-does-not-compile", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {
         "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "required": "a"}}}}, 400,
     "response_format", None, ["required"]),
    ("json-schema-does-not-compile-stream", "/v1/completions",
     {"prompt": "x", "stream": True, "response_format": {
         "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "(["}}}}, 400,
     "response_format", None, ["Regex"]),
    ("json-with-ignore-eos", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "ignore_eos": True},
     400, "ignore_eos", None, ["ignore_eos"]),
    ("completion-suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", None, ["suffix"]),
    ("completion-best-of", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", None, ["best_of"]),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, None, None, []),
]


@pytest.fixture(scope="module")
def metrics_before_errors(server):
    return wait_idle(server)


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_responses(server, metrics_before_errors, case):
    _, path, body, status, param, code, words = case
    if isinstance(body, bytes):
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server + path, json={"model": MODEL, **body} if "model" not in body else body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    for word in words:
        assert word in error["message"], error["message"]


def test_errors_touch_no_kv_block(server, metrics_before_errors):
    """Runs after the error cases: none of them reached the scheduler or left a block in use."""
    after = wait_idle(server)
    assert metric(after, "kvreuse_kv_blocks", state="in_use") == 0
    for name in ("kvreuse_prompt_tokens_total", "kvreuse_generation_tokens_total",
                 "kvreuse_e2e_request_latency_seconds_count"):
        assert metric(after, name) == metric(metrics_before_errors, name), name
