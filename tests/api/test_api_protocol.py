"""The HTTP layer's pieces that need no engine: request models, request -> engine arguments, error messages,
chat prompt rendering and the SSE framing of streamed chunks."""
import asyncio
import json

import pytest
from pydantic import ValidationError
from tokenizers.processors import TemplateProcessing

from blend.chunking import encode, render_chat_chunks
from reuse_server.api.chat import PreparedChat, answer_steps
from reuse_server.api.chat_completions import chat_chunks
from reuse_server.api.chat_template import NO_TOOLS, PART_SEPARATOR, conversation, render_chat_prompt
from reuse_server.api.completions import completion_chunks, completion_prompt
from reuse_server.api.errors import describe_validation_error
from reuse_server.api.generation import (SSE_DONE, cache_options, check_common, choice_params, interleave,
                                         sampling_params, sse_events)
from reuse_server.api.prompt_chunks import leading_special_tokens
from reuse_server.api.protocol import CacheChunksRequest, ChatCompletionRequest, CompletionRequest
from reuse_server.engine.outputs import RequestOutput, TokenLogprob
from reuse_server.engine.sampling_params import CacheOptions, InvalidRequest, SamplingParams
from tiny_checkpoint import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# ---------------------------------------------------------------- request models


@pytest.mark.parametrize("prompt", ["hello", [5, 6, 7], ["hello"], [[5, 6, 7]]])
def test_completion_prompt_shapes_accepted(prompt, tokenizer):
    req = CompletionRequest(prompt=prompt)
    ids, spans = completion_prompt(tokenizer, req.prompt)
    expected = tokenizer.encode("hello") if "hello" in json.dumps(prompt) else [5, 6, 7]
    assert ids == expected and spans == []


@pytest.mark.parametrize("prompt", [[1, "a"], [["a"]], 5, {"text": "x"}, [1.5]])
def test_completion_prompt_bad_shapes_rejected(prompt):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(prompt=prompt)
    message, param = describe_validation_error(err.value.errors())
    assert param == "prompt" and "prompt must be" in message


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
def test_batched_prompts_rejected(prompt, tokenizer):
    with pytest.raises(InvalidRequest) as err:
        completion_prompt(tokenizer, CompletionRequest(prompt=prompt).prompt)
    assert err.value.param == "prompt" and "2 prompts" in err.value.message


@pytest.mark.parametrize("prompt, separator", [("", None), ([], None), ([[]], None), ("", "##"), ("####", "##")])
def test_empty_prompt_rejected(prompt, separator, tokenizer):
    with pytest.raises(InvalidRequest, match="empty"):
        completion_prompt(tokenizer, CompletionRequest(prompt=prompt).prompt, separator)


def test_separator_splits_a_text_prompt_into_reusable_chunks(tokenizer):
    pieces = ["Paris is the capital of France. ", "The quick brown fox. ", "Where is Paris?"]
    ids, spans = completion_prompt(tokenizer, "##".join(pieces), "##")
    alone = [list(encode(tokenizer, p)) for p in pieces]
    assert ids == [t for a in alone for t in a]  # each piece tokenized alone, the separator removed
    assert spans == [(0, len(alone[0])), (len(alone[0]), len(alone[1])),
                     (len(alone[0]) + len(alone[1]), len(alone[2]))]
    # the tokens of a piece do not depend on what surrounds it
    ids2, spans2 = completion_prompt(tokenizer, pieces[1] + "##" + pieces[0], "##")
    assert ids2[spans2[1][0]:] == alone[0]
    # token-id prompts and prompts without a server separator have no chunks
    assert completion_prompt(tokenizer, [5, 6, 7], "##") == ([5, 6, 7], [])
    assert completion_prompt(tokenizer, "##".join(pieces), None).chunk_spans == []


def test_separator_keeps_the_tokenizers_leading_special_tokens():
    bos_tok = build_tokenizer()  # a Llama-style tokenizer: encode() prepends BOS (id 1)
    bos_tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                            special_tokens=[("<|im_start|>", 1)])
    assert leading_special_tokens(bos_tok) == [1] and leading_special_tokens(build_tokenizer()) == []
    ids, spans = completion_prompt(bos_tok, "abc##def", "##")
    assert ids == [1, *encode(bos_tok, "abc"), *encode(bos_tok, "def")]
    assert spans == [(1, len(encode(bos_tok, "abc"))), (1 + len(encode(bos_tok, "abc")), len(encode(bos_tok, "def")))]
    assert completion_prompt(bos_tok, "abcdef").token_ids[0] == 1  # as without a separator


def test_unknown_top_level_fields_ignored_but_not_inside_kv_blend():
    req = CompletionRequest(prompt="x", frequency_penalty=0.5, some_future_field={"a": 1})
    assert not hasattr(req, "some_future_field")
    with pytest.raises(ValidationError) as err:
        CompletionRequest(prompt="x", kv_blend={"enabled": True, "recompute_ratoi": 0.2})
    message, param = describe_validation_error(err.value.errors())
    assert param == "kv_blend.recompute_ratoi" and "kv_blend.recompute_ratoi" in message


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_recompute_ratio_out_of_range(ratio):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(prompt="x", kv_blend={"recompute_ratio": ratio})
    assert describe_validation_error(err.value.errors())[1] == "kv_blend.recompute_ratio"


def test_cache_options_from_extensions():
    req = CompletionRequest(prompt="x", prefix_cache=False, cache_salt="tenant-a",
                            kv_blend={"enabled": True, "recompute_ratio": 0.25})
    opts = cache_options(req, [(0, 9), (12, 40)])
    assert (opts.prefix_cache, opts.cache_salt, opts.blend, opts.recompute_ratio) == (False, "tenant-a", True, 0.25)
    assert opts.chunk_spans == [(0, 9), (12, 40)]
    default = cache_options(CompletionRequest(prompt="x"))
    assert (default.prefix_cache, default.cache_salt, default.blend, default.recompute_ratio) == (True, None, None, None)
    assert default.chunk_spans == []
    assert cache_options(CompletionRequest(prompt="x", kv_blend={"enabled": False})).blend is False


def test_sampling_params_mapping_and_ranges():
    req = CompletionRequest(prompt="x", temperature=0, top_p=0.5, top_k=3, seed=7, stop="\n",
                            stop_token_ids=[2], ignore_eos=True)
    p = sampling_params(req, 9, 2)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.stop_token_ids, p.ignore_eos,
            p.logprobs) == (9, 0.0, 0.5, 3, 7, ["\n"], [2], True, 2)
    nulls = sampling_params(CompletionRequest(prompt="x", temperature=None, top_p=None), 16, None)
    assert (nulls.temperature, nulls.top_p, nulls.top_k) == (1.0, 1.0, -1)
    # the ranges are checked once, with the prompt, by the engine's validate_prompt (which runs validate())
    for field, value in [("temperature", 2.5), ("top_p", 0.0), ("top_k", 0), ("stop", ["a"] * 5)]:
        with pytest.raises(InvalidRequest) as err:
            sampling_params(CompletionRequest(prompt="x", **{field: value}), 16, None).validate()
        assert err.value.param == field
    with pytest.raises(InvalidRequest) as err:
        sampling_params(CompletionRequest(prompt="x"), 0, None).validate()
    assert err.value.param == "max_tokens"


def test_n_and_stream_options_checks():
    for n in (0, 17):
        with pytest.raises(InvalidRequest) as err:
            check_common(CompletionRequest(prompt="x", n=n))
        assert err.value.param == "n"
    check_common(CompletionRequest(prompt="x", n=16))
    with pytest.raises(InvalidRequest) as err:
        check_common(CompletionRequest(prompt="x", stream_options={"include_usage": True}))
    assert err.value.param == "stream_options"
    check_common(CompletionRequest(prompt="x", n=1, stream=True, stream_options={"include_usage": True}))


# ---------------------------------------------------------------- chat messages


def _chat_chunk_case():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Document one. "}, {"type": "text", "text": "capi"},
                                     {"type": "text", "text": "tal of France?"}]},
    ]
    # vLLM's convention for string-content templates: a message's text parts joined with "\n"
    joined = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Document one. \ncapi\ntal of France?"}]
    return ChatCompletionRequest(messages=messages).messages, joined


def test_text_parts_are_joined_with_a_newline_as_vllm_does(tokenizer):
    messages, joined = _chat_chunk_case()
    ids, _ = render_chat_prompt(tokenizer, messages)
    text = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == text
    assert "Document one. \ncapi\ntal of France?<|im_end|>" in tokenizer.decode(ids)


def test_chat_chunks_concatenate_to_the_templates_rendering(tokenizer):
    messages, joined = _chat_chunk_case()
    chunks = render_chat_chunks(tokenizer, conversation(messages), part_separator=PART_SEPARATOR)
    text = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
    assert "".join(c.text for c in chunks) == text
    assert text.endswith("<|im_start|>assistant\n")
    assert [c.text for c in chunks if c.reusable] == ["Be brief.", "Document one. ", "capi", "tal of France?"]
    # the separator is framing of its own between the parts, not glued to a passage
    user = [c.text for c in chunks][[c.text for c in chunks].index("Document one. "):]
    assert user[:5] == ["Document one. ", "\n", "capi", "\n", "tal of France?"]


def test_chat_prompt_is_the_chunks_tokenized_alone(tokenizer):
    messages, joined = _chat_chunk_case()
    ids, spans = render_chat_prompt(tokenizer, messages)
    chunks = render_chat_chunks(tokenizer, conversation(messages), part_separator=PART_SEPARATOR)
    assert ids == [t for c in chunks for t in encode(tokenizer, c.text)]
    assert [tokenizer.decode(ids[s:s + n]) for s, n in spans] == ["Be brief.", "Document one. ", "capi",
                                                                  "tal of France?"]
    assert [ids[s:s + n] for s, n in spans][1:] == [list(encode(tokenizer, t)) for t in
                                                   ["Document one. ", "capi", "tal of France?"]]
    whole = tokenizer.encode(tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)
    assert tokenizer.decode(ids) == tokenizer.decode(whole)


def test_chat_message_position_does_not_change_its_tokens(tokenizer):
    passage = {"type": "text", "text": "A paged KV cache stores keys and values in fixed-size blocks."}
    other = {"type": "text", "text": "The quick brown fox jumps over the lazy dog. "}
    a = render_chat_prompt(tokenizer, ChatCompletionRequest(messages=[
        {"role": "user", "content": [other, passage]}]).messages)
    b = render_chat_prompt(tokenizer, ChatCompletionRequest(messages=[
        {"role": "system", "content": "hi"}, {"role": "user", "content": [passage, other]}]).messages)
    (sa, na), (sb, nb) = a.chunk_spans[1], b.chunk_spans[1]
    assert na == nb and a.token_ids[sa:sa + na] == b.token_ids[sb:sb + nb]


@pytest.mark.parametrize("content, needle", [
    ([{"type": "text", "text": ""}], "non-empty"),
    ([{"type": "image_url", "image_url": {"url": "http://x"}}], "'image_url'"),
    ([{"text": "no type"}], "only parts of type 'text'"),
    (42, "string or a list"),
])
def test_bad_chat_content_rejected(content, needle):
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest(messages=[{"role": "user", "content": content}])
    message, param = describe_validation_error(err.value.errors())
    assert param == "messages[0].content" and needle in message


def test_cache_chunks_request_checks():
    assert CacheChunksRequest(chunks=["a", "b"], cache_salt="t").chunks == ["a", "b"]
    for body, param in [({"chunks": []}, "chunks"), ({"chunks": ["a", ""]}, "chunks[1]"),
                        ({"chunks": ["a"] * 257}, "chunks"), ({"chunks": [3]}, "chunks[0]"),
                        ({"chunks": ["a"], "max_tokens": 3}, "max_tokens"), ({}, "chunks")]:
        with pytest.raises(ValidationError) as err:
            CacheChunksRequest.model_validate(body)
        assert describe_validation_error(err.value.errors())[1] == param, body


def test_bad_role_and_empty_messages_rejected():
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    assert describe_validation_error(err.value.errors())[1] == "messages[1].role"
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest(messages=[])
    assert describe_validation_error(err.value.errors())[1] == "messages"


def test_chat_without_template_is_a_client_error(tokenizer):
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template"):
        render_chat_prompt(bare, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).messages)


def test_lone_surrogates_rejected_with_their_place():
    body = json.loads('{"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, '
                      '{"type": "text", "text": "x\\udc00"}]}]}')  # json.loads, as FastAPI parses bodies
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate(body)
    assert "messages[0].content[1].text is not valid Unicode" in describe_validation_error(err.value.errors())[0]
    assert CompletionRequest.model_validate(json.loads('{"prompt": "caf\\u00e9 \\ud83d\\ude00"}')).prompt == "café 😀"


def test_seed_limited_to_what_torch_accepts():
    assert CompletionRequest(prompt="x", seed=2**64 - 1).seed == 2**64 - 1
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", seed=seed)


def test_invalid_json_message():
    errors = [{"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error",
               "ctx": {"error": "Expecting value"}}]
    message, param = describe_validation_error(errors)
    assert message == "The request body is not valid JSON: Expecting value" and param is None


# ---------------------------------------------------------------- SSE framing


def _outputs(texts, finish_reason="length", cached=4, logprobs=False):
    outs = []
    for i, text in enumerate(texts):
        lp = [TokenLogprob(10 + i, text, -0.5, [(10 + i, text, -0.5), (99, "zz", -1.5)])] if logprobs else None
        outs.append(RequestOutput("r", [10 + i], text, i == len(texts) - 1,
                                  finish_reason if i == len(texts) - 1 else None, num_prompt_tokens=7,
                                  num_output_tokens=i + 1, cached_tokens=cached, logprobs=lp))
    return outs


async def _aiter(items):
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def _frames(chunks_factory, items):
    async def run():
        outputs = interleave([_aiter(items)])
        return [frame async for frame in sse_events(chunks_factory(outputs), outputs)]

    frames = asyncio.run(run())
    assert all(f.startswith("data: ") and f.endswith("\n\n") and "\n" not in f[:-2] for f in frames)
    assert frames[-1] == SSE_DONE
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def _chat_chunks(request_id, created, include_usage, logprobs):
    chat = PreparedChat(request_id, [1], SamplingParams(), NO_TOOLS, CacheOptions(), 1)
    return lambda outputs: chat_chunks(chat, answer_steps(chat, outputs), created, "m", include_usage, logprobs)


def test_chat_stream_frames_match_openai():
    events = _frames(_chat_chunks("chatcmpl-1", 123, True, False), _outputs(["Hel", "", "lo"]))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == "chatcmpl-1" and e["model"] == "m"
               for e in events)
    body = events[1:-2]
    assert [e["choices"][0]["delta"] for e in body] == [{"content": "Hel"}, {"content": "lo"}]  # empty delta skipped
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    finish = events[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                   "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0,
                                                             "blended_tokens": 0, "recomputed_tokens": 0,
                                                             "tier_tokens": {"host": 0, "disk": 0, "redis": 0}}}
    assert all("usage" not in e for e in events[:-1])


def test_chat_stream_without_usage_and_with_logprobs():
    events = _frames(_chat_chunks("c", 1, False, True), _outputs(["a", "b"], "stop", logprobs=True))
    assert all("usage" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "stop"
    content = [e["choices"][0]["logprobs"]["content"][0] for e in events[1:-1]]
    assert [c["token"] for c in content] == ["a", "b"]
    assert content[0]["bytes"] == [97] and [t["token"] for t in content[0]["top_logprobs"]] == ["a", "zz"]


def test_completion_stream_frames():
    events = _frames(lambda o: completion_chunks(o, 1, "cmpl-1", 5, "m", True, True),
                     _outputs(["ab", "c"], "stop", logprobs=True))
    assert all(e["object"] == "text_completion" for e in events)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["ab", "c", ""]
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events[:2]] == [[0], [2]]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("error, expected_type", [(InvalidRequest("too long", "prompt"), "invalid_request_error"),
                                                  (RuntimeError("boom"), "server_error")])
def test_error_after_stream_started_is_an_error_event(error, expected_type):
    events = _frames(_chat_chunks("c", 1, True, False), [*_outputs(["a", "b"])[:1], error])
    assert events[-1]["error"]["type"] == expected_type
    assert "boom" not in json.dumps(events[-1])  # internals stay in the log


def test_closing_the_stream_closes_the_engine_iterator():
    closed = []

    async def engine_outputs():
        try:
            for out in _outputs(["a", "b", "c", "d"]):
                yield out
        finally:
            closed.append(True)

    async def run():
        outputs = interleave([engine_outputs()])
        events = sse_events(_chat_chunks("c", 1, False, False)(outputs), outputs)
        await events.__anext__()
        await events.__anext__()
        await events.aclose()  # what SSEResponse does when the client goes away mid-stream

    asyncio.run(run())
    assert closed == [True]


def test_interleaved_choices_are_tagged_and_closing_closes_them_all():
    closed = []

    async def engine_outputs(name, texts):
        try:
            for out in _outputs(texts):
                await asyncio.sleep(0)
                yield out
        finally:
            closed.append(name)

    async def run(read_all):
        merged = interleave([engine_outputs("a", ["x", "y", "z"]), engine_outputs("b", ["p", "q"])])
        if read_all:
            return [(i, out.new_text) async for i, out in merged]
        first = await merged.__anext__()
        await merged.aclose()  # the client left
        return [first]

    got = asyncio.run(run(True))
    assert [t for i, t in got if i == 0] == ["x", "y", "z"] and [t for i, t in got if i == 1] == ["p", "q"]
    assert sorted(closed) == ["a", "b"]
    closed.clear()
    assert len(asyncio.run(run(False))) == 1
    assert sorted(closed) == ["a", "b"]  # both engine requests were closed, so both are aborted


def test_each_choice_gets_its_own_seed():
    params = sampling_params(CompletionRequest(prompt="x", seed=7, temperature=1.0), 16, None)
    assert [p.seed for p in choice_params(params, 3)] == [7, 8, 9]
    assert [p.seed for p in choice_params(sampling_params(CompletionRequest(prompt="x"), 16, None), 2)] == [None, None]
    assert choice_params(sampling_params(CompletionRequest(prompt="x", seed=2**64 - 1), 16, None), 2)[1].seed == 2**64 - 2
