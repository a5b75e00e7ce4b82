"""Tool calling without a server: checking tools and tool_choice, rendering tools and earlier calls through a
chat template (one that takes tools, and the fallback for one that does not), the grammar that holds calls
to a valid form, and reading calls back out of whole and streamed answers."""
import json
import random

import pytest
from pydantic import ValidationError

from blend.chunking import render_chat_chunks
from reuse_server.api.chat_template import PART_SEPARATOR, conversation, render_chat_prompt
from reuse_server.api.protocol import ChatCompletionRequest
from reuse_server.api.tools import (ToolCallStream, _warn_free_arguments, call_text, finish_reason, output_constraint, output_grammar,
                                    parse_tool_calls, template_renders_tools, tool_settings, tools_block)
from reuse_server.engine.sampling_params import InvalidRequest
from reuse_server.engine.structured_output import GrammarCompiler
from tiny_checkpoint import build_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty arguments object
USER = {"role": "user", "content": "Weather in Paris?"}

# A template in the style of Qwen2.5's: takes `tools`, renders calls with their arguments as an object and
# tool outputs inside <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # ChatML without tools: the fallback


@pytest.fixture(scope="module")
def tools_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=body.pop("messages", [USER]), **body)


def history(arguments: str = '{"city": "Paris", "days": 2}') -> list[dict]:
    """A step after one call: the call as the client sends it back, and the tool's output."""
    return [USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and 21 degrees all week in Paris."}]


# ---------------------------------------------------------------- tools and tool_choice


@pytest.mark.parametrize("choice, expected", [
    (None, ("auto", None)), ("none", ("none", None)), ("required", ("required", None)),
    ({"type": "function", "function": {"name": "get_time"}}, ("function", "get_time")),
])
def test_tool_choice_forms(choice, expected):
    settings = tool_settings(request(tools=[WEATHER, TIME], tool_choice=choice))
    assert (settings.choice, settings.function) == expected
    assert settings.parses_calls == (expected[0] != "none")
    assert [t["function"]["name"] for t in settings.tools] == ["get_weather", "get_time"]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER, WEATHER]}, "tools", ["get_weather", "more than once"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", ["nope"]),
    ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
])
def test_tool_settings_refuse_what_no_model_can_honour(body, param, words):
    with pytest.raises(InvalidRequest) as err:
        tool_settings(request(**body))
    assert err.value.param == param and all(w in err.value.message for w in words)


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"description": "no name"}},
    {"type": "function", "function": {"name": "has space"}},
    {"type": "custom", "custom": {"name": "f"}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
])
def test_bad_tool_definitions_fail_validation(tool):
    with pytest.raises(ValidationError):
        request(tools=[tool])


# ---------------------------------------------------------------- rendering


def test_template_detection(tokenizer, tools_tokenizer):
    assert not template_renders_tools(tokenizer) and template_renders_tools(tools_tokenizer)


def test_fallback_puts_tools_in_the_system_message_as_a_part_of_their_own(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, USER]
    settings = tool_settings(request(messages=messages, tools=[WEATHER, TIME]))
    body = request(messages=messages, tools=[WEATHER, TIME])
    prompt = render_chat_prompt(tokenizer, body.messages, settings)
    text = tokenizer.decode(prompt.token_ids)
    block = tools_block(settings.tools)
    # first, before the instructions: two users whose instructions differ share the tools' tokens
    assert text.startswith("<|im_start|>system\n" + block + PART_SEPARATOR + "Be brief.<|im_end|>")
    other = [{"role": "system", "content": "Be thorough."}, USER]
    other_ids = render_chat_prompt(tokenizer, request(messages=other, tools=[WEATHER, TIME]).messages,
                                   settings).token_ids
    shared = next(i for i, (a, b) in enumerate(zip(prompt.token_ids, other_ids)) if a != b)
    assert shared >= len(tokenizer.encode("<|im_start|>system\n" + block, add_special_tokens=False))
    assert json.dumps(WEATHER) in block and json.dumps(TIME) in block
    # the block is a chunk of its own: the same tokens whatever the system message says
    block_ids = tokenizer.encode(block, add_special_tokens=False)
    assert any(prompt.token_ids[s:s + n] == block_ids for s, n in prompt.chunk_spans)
    # without a system message the block makes one, first
    alone = render_chat_prompt(tokenizer, request(tools=[WEATHER]).messages, tool_settings(request(tools=[WEATHER])))
    assert tokenizer.decode(alone.token_ids).startswith("<|im_start|>system\n" + tools_block((WEATHER,)))


def test_fallback_writes_calls_back_as_the_model_wrote_them_and_tool_outputs_as_chunks(tokenizer):
    arguments = '{"city": "Paris",  "days": 2}'  # the model's own spacing is kept
    body = request(messages=history(arguments), tools=[WEATHER])
    prompt = render_chat_prompt(tokenizer, body.messages, tool_settings(body))
    text = tokenizer.decode(prompt.token_ids)
    written = call_text("get_weather", arguments)
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in text
    assert parse_tool_calls(written).calls[0].arguments == arguments  # what the server answered is what comes back
    assert "<|im_start|>tool\n<tool_response>\nSunny and 21 degrees all week in Paris.\n</tool_response><|im_end|>" in text
    output = tokenizer.encode("Sunny and 21 degrees all week in Paris.", add_special_tokens=False)
    assert any(prompt.token_ids[s:s + n] == output for s, n in prompt.chunk_spans), "the tool output is a chunk"


def test_a_tool_step_extends_the_previous_prompt(tokenizer):
    """The next agent step repeats the previous prompt token for token (then the call and the output)."""
    first_body = request(tools=[WEATHER])
    first = render_chat_prompt(tokenizer, first_body.messages, tool_settings(first_body))
    second_body = request(messages=history(), tools=[WEATHER])
    second = render_chat_prompt(tokenizer, second_body.messages, tool_settings(second_body))
    assert second.token_ids[:len(first.token_ids)] == first.token_ids


def test_template_that_takes_tools_gets_them_with_arguments_as_objects(tools_tokenizer):
    body = request(messages=history(), tools=[WEATHER])
    prompt = render_chat_prompt(tools_tokenizer, body.messages, tool_settings(body))
    text = tools_tokenizer.decode(prompt.token_ids)
    assert json.dumps(WEATHER) in text and "# Tools" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nSunny and 21 degrees" in text
    assert TOOLS_TEMPLATE and "You may call one or more functions" not in text  # no fallback block as well
    output = tools_tokenizer.encode("Sunny and 21 degrees all week in Paris.", add_special_tokens=False)
    assert any(prompt.token_ids[s:s + n] == output for s, n in prompt.chunk_spans)


def test_call_arguments_that_are_not_json_are_refused(tokenizer, tools_tokenizer):
    for tok in (tokenizer, tools_tokenizer):
        body = request(messages=history('{"city": '), tools=[WEATHER])
        with pytest.raises(InvalidRequest, match="not valid JSON"):
            render_chat_prompt(tok, body.messages, tool_settings(body))


def test_messages_without_tools_render_as_before(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [
        {"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]
    body = request(messages=messages)
    direct = render_chat_chunks(tokenizer, conversation(body.messages), part_separator=PART_SEPARATOR)
    assert render_chat_prompt(tokenizer, body.messages).token_ids == [t for c in direct for t in c.tokens]


# ---------------------------------------------------------------- decoding constraints


def accepts(grammars, constraint, text: str, then_eos: bool = True) -> bool:
    """Whether the compiled constraint accepts `text` (as a string) and then the end of the output."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammars.compile(constraint).compiled)
    ok = matcher.accept_string(text)
    return ok and (matcher.accept_token(grammars._stop_token_ids[0]) if then_eos else True)


CALL = call_text("get_weather", '{"city": "Paris", "days": 3}')


@pytest.mark.parametrize("choice, text, ok", [
    ("auto", "Let me check. " + CALL, True),
    ("auto", "No call needed.", True),
    ("auto", call_text("get_weather", '{"city": "Rome", "days": 3}'), False),  # not in the enum
    ("auto", call_text("rm_rf", "{}"), False),  # not a tool
    ("required", "No call needed.", False),
    ("required", CALL, True),
    ("required", CALL + "\n" + call_text("get_time", "{}"), True),
    ("function", call_text("get_time", "{}"), True),
    ("function", CALL, False),
])
def test_tool_call_grammar(grammars, choice, text, ok):
    body = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
                   if choice == "function" else choice)
    assert accepts(grammars, output_constraint(tool_settings(body), None), text) == ok


def test_parallel_tool_calls_false_allows_one_call(grammars):
    body = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    constraint = output_constraint(tool_settings(body), None)
    assert accepts(grammars, constraint, CALL)
    assert not accepts(grammars, constraint, CALL + "\n" + call_text("get_time", "{}"))


def test_tools_and_a_response_format_allow_either(grammars):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    body = request(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    constraint = output_constraint(tool_settings(body), body.response_format)
    assert accepts(grammars, constraint, '{"answer": "sunny"}') and accepts(grammars, constraint, CALL)
    assert not accepts(grammars, constraint, "sunny")
    # tool_choice none: the response format alone
    none = request(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"})
    assert output_constraint(tool_settings(none), none.response_format).kind == "json_object"
    assert output_constraint(tool_settings(request()), None) is None


def test_a_tool_grammar_that_cannot_compile_is_a_clear_error_from_the_compiler(grammars):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(["}}}}}
    body = request(tools=[bad], tool_choice="required")
    with pytest.raises(InvalidRequest) as err:
        grammars.compile(output_constraint(tool_settings(body), None))
    assert err.value.param == "tools" and "[" in err.value.message and "/project" not in err.value.message


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def one_property(schema: dict) -> dict:
    """A tool's parameters in the form Claude Code's tools have them (zod's JSON schema, draft 2020-12)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {"x": schema}, "required": ["x"], "additionalProperties": False}


# The keywords Claude Code 2.1's 24 tools use, each in the form one of them has it (captured from its
# requests), with an argument value it allows and one it does not.
CLAUDE_CODE_KEYWORDS = {
    "$schema": ({"type": "string"}, '"a"', "1"),
    "anyOf+const": ({"anyOf": [{"type": "string", "enum": ["pending", "completed"]},
                               {"type": "string", "const": "deleted"}]}, '"deleted"', '"gone"'),
    "propertyNames": ({"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}},
                      '{"k": [1]}', '"k"'),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991}, "3", "0"),
    "format": ({"type": "string", "format": "uri"}, '"https://example.com/a"', "7"),
    "pattern": ({"type": "string", "pattern": "^wf_[a-z0-9-]{6,}$"}, '"wf_abc-123"', '"wf_A"'),
    "minLength": ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    "maxItems": ({"type": "array", "items": {"type": "string"}, "maxItems": 2}, '["a"]', '["a", "b", "c"]'),
    "default+minimum+maximum": ({"default": 30000, "type": "number", "minimum": 0, "maximum": 600000}, "5", "-1"),
}


@pytest.mark.parametrize("keyword", CLAUDE_CODE_KEYWORDS)
def test_the_schema_keywords_claude_code_sends_compile_and_hold_the_call(grammars, keyword, caplog):
    schema, good, bad = CLAUDE_CODE_KEYWORDS[keyword]
    settings = tool_settings(request(tools=[tool("t", one_property(schema))], tool_choice="required"))
    with caplog.at_level("WARNING", logger="reuse_server.api"):
        grammar = output_grammar(grammars, settings, None)
    assert not caplog.records  # compiled as sent: no fallback
    assert grammar_accepts(grammar, grammars, call_text("t", f'{{"x": {good}}}'))
    assert not grammar_accepts(grammar, grammars, call_text("t", f'{{"x": {bad}}}'))


def grammar_accepts(grammar, grammars, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar.compiled)
    return matcher.accept_string(text) and matcher.accept_token(grammars._stop_token_ids[0])


# Schemas real clients send that xgrammar 0.1 refuses: regex features it lacks, draft-04's boolean
# exclusiveMinimum (OpenAPI 3.0-derived tools), a schema that accepts nothing.
REFUSED_BY_XGRAMMAR = {
    "unicode class": {"type": "string", "pattern": "^\\p{L}+$"},
    "word boundary": {"type": "string", "pattern": "\\bmain\\b"},
    "lookbehind": {"type": "string", "pattern": "(?<=v)[0-9]+"},
    "backreference": {"type": "string", "pattern": "^(a)\\1$"},
    "boolean exclusiveMinimum": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
    "false schema": False,
}


@pytest.mark.parametrize("what", REFUSED_BY_XGRAMMAR)
def test_a_schema_xgrammar_refuses_leaves_only_that_tools_arguments_free(grammars, what, caplog):
    refused = tool("free", {"type": "object", "properties": {"x": REFUSED_BY_XGRAMMAR[what]}})
    with pytest.raises(InvalidRequest):  # xgrammar does refuse it: the case the fallback is for
        grammars.compile(output_constraint(tool_settings(request(tools=[refused], tool_choice="required")), None))
    settings = tool_settings(request(tools=[WEATHER, refused], tool_choice="required"))
    _warn_free_arguments.cache_clear()  # logged once per tool and reason in a process
    with caplog.at_level("WARNING", logger="reuse_server.api"):
        grammar = output_grammar(grammars, settings, None)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'free'" in warnings[0] and "any JSON object" in warnings[0], warnings
    # the refused tool's arguments: any JSON object, but an object and a complete call
    assert grammar_accepts(grammar, grammars, call_text("free", '{"x": "anything", "y": [1, {"z": null}]}'))
    assert not grammar_accepts(grammar, grammars, call_text("free", '"not an object"'))
    # the other tool is still held to its own schema
    assert grammar_accepts(grammar, grammars, CALL)
    assert not grammar_accepts(grammar, grammars, call_text("get_weather", '{"city": "Rome", "days": 3}'))
    assert not grammar_accepts(grammar, grammars, call_text("rm_rf", "{}"))


def test_a_response_format_that_cannot_compile_is_still_a_400(grammars):
    body = request(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"x": {"type": "string", "pattern": "\\bx"}}}}})
    with pytest.raises(InvalidRequest) as err:
        output_grammar(grammars, tool_settings(body), body.response_format)
    assert "Word boundary" in err.value.message


# ---------------------------------------------------------------- reading calls back

ANSWERS = [
    ("Sure.\n" + CALL + "\n" + call_text("get_time", "{}"), "Sure.",
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    (CALL, None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    ('<tool_call>\n{"arguments": {"x": [1, {"y": null}]}, "name": "f"}\n</tool_call>', None, [("f", '{"x": [1, {"y": null}]}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),
    # raw control characters inside strings (grammars of length-bounded strings allow them) come back escaped
    ('<tool_call>\n{"name": "f", "arguments": {\t"q": "a\x17b\tc" }}\n</tool_call>', None,
     [("f", '{\t"q": "a\\u0017b\\tc" }')]),
    ("plain <tool text, no call", "plain <tool text, no call", []),
    ("<tool_call>\nnot json\n</tool_call> then text", "<tool_call>\nnot json\n</tool_call> then text", []),
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_parse_whole_answers(text, content, calls):
    parsed = parse_tool_calls(text)
    got_content, got = parsed.content, parsed.calls
    assert got_content == content and parsed.cut == 0 and [(c.name, c.arguments) for c in got] == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in got)  # strict JSON
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)
    assert finish_reason("stop", bool(got)) == ("tool_calls" if calls else "stop")
    assert finish_reason("length", bool(got)) == "length"


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_streamed_answers_give_the_same_calls_however_the_text_is_cut(text, content, calls):
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(40, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = ToolCallStream()
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
        streamed: dict[int, list] = {}
        for e in events:
            if e.kind == "call":
                assert e.index == len(streamed) and e.id.startswith("call_")
                streamed[e.index] = [e.name, ""]
            elif e.kind == "arguments":
                streamed[e.index][1] += e.text
        assert "".join(e.text for e in events if e.kind == "content") == (content or ""), pieces
        assert [tuple(v) for v in streamed.values()] == calls, pieces
        # a call's first event carries its name before any of its arguments
        kinds = [(e.kind, e.index) for e in events if e.kind != "content"]
        for index in streamed:
            assert kinds.index(("call", index)) < min((k for k, x in enumerate(kinds) if x == ("arguments", index)),
                                                      default=len(kinds))


# What SmolLM2 wrote with tool_choice "required" and parallel calls allowed: one call, then the start of
# another until max_tokens.
SMOLLM2_CUT = ('<tool_call>\n{"name": "lookup_population", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "lookup_population", "arguments": { "city')
CUT_ANSWERS = [
    (SMOLLM2_CUT, None, [("lookup_population", '{"city": "Paris"}')], "tool_calls", 1),
    ('<tool_call>\n{"name": "f", "arguments": {"city": "Par', None, [], "length", 1),  # the only call was cut
    (CALL + "\n<tool_", None, [("get_weather", '{"city": "Paris", "days": 3}')], "tool_calls", 1),  # in the tag
    ("Sure.\n" + CALL + " and then some te", "Sure.\n and then some te",
     [("get_weather", '{"city": "Paris", "days": 3}')], "length", 0),  # the content after the call was cut
    ("Sure.\n<tool_call>\n{\"na", "Sure.", [], "length", 1),
]


@pytest.mark.parametrize("text, content, calls, reason, cut", CUT_ANSWERS)
def test_a_cut_call_is_dropped_never_content(text, content, calls, reason, cut):
    """An answer that ran out of tokens inside a call: the complete calls are returned, the cut one is
    dropped (and counted), whole or streamed however the text is cut, and nothing of it is content."""
    parsed = parse_tool_calls(text, truncated=True)
    assert parsed.content == content and [(c.name, c.arguments) for c in parsed.calls] == calls
    assert parsed.finish_reason("length") == reason and "<tool" not in (parsed.content or "")
    assert parsed.cut == cut
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(30, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = ToolCallStream()
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish(truncated=True)
        streamed_content = "".join(e.text for e in events if e.kind == "content")
        assert streamed_content.split() == (content or "").split(), pieces  # the same words; spacing may differ
        streamed = [(e.name, events[k + 1].text) for k, e in enumerate(events) if e.kind == "call"]
        assert streamed == calls and stream.cut == parsed.cut and stream.finish_reason("length") == reason, pieces
