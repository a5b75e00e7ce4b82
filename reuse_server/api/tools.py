"""Tool calling: the request's tools and tool_choice, how tools and earlier calls reach the chat template,
the grammar that holds the model's calls to a valid form, and reading the calls back out of its text.

Call format: Hermes's, which Qwen2/2.5 and other ChatML models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rendering. A chat template that takes `tools` and renders assistant `tool_calls` (Qwen2.5, Hermes) gets
them as transformers passes them, with each call's arguments as an object. A template that does not
(SmolLM2's, plain ChatML) gets the documented fallback:
- the tools, one JSON definition a line, in a Hermes/Qwen-style block put as its own text part at the start
  of the first system message (a system message holding only the block is put first when there is none):
  before the instructions, as Anthropic's prompt caching orders a prompt (tools, system, messages), because
  the tools are what every user of an agent shares, while its instructions carry each user's details early
  (Claude Code writes the user's working and memory folders near the top of its system prompt): after
  those, the tools would be computed again for every new session;
- an assistant message's calls as the `<tool_call>` text above, each its own text part after its content,
  with the arguments exactly as the client sent them back (our own answer's text: the next step's prompt
  then repeats the tokens of the previous answer, which stay cached);
- a tool message's output between `<tool_response>` and `</tool_response>` parts, so the output itself
  stays a chunk of its own that blending can reuse wherever it appears.
Parts are joined with "\\n" like any content parts. Tools are rendered whatever tool_choice says ("none"
included), so the prompt's prefix stays the same from one agent step to the next.

Gemma 3 (our template, model/chat_templates.py) gets this fallback inside its turns: the system message with
the block lands in the first user turn (where Google's "Function calling with Gemma" describes tools), calls in
the model turn, tool outputs in the user turn. Google's own forms were measured against it
(benchmarks/bench_gemma_tool_form.py): a call as Python (`[f(a=1)]`) or as bare `{"name": ..., "parameters":
...}`, in a ```tool_code``` block. Shown the tools and a question needing one, the 270M base model wrote a call
in none of the three forms by itself (0 of 8 each: it repeats the prompt), so its calls come from the grammar
below, which needs tags around a JSON call: a Python call cannot be held to a parameters schema, and a bare
JSON call opens with nothing that tells it from a JSON answer (response_format).

Decoding. With tool_choice "auto" the model may write text, but once it writes `<tool_call>` the rest of
the call is held to a known function's name and its parameters' schema; "required" allows only calls,
a named function only that one call (structured_output.py compiles these as xgrammar structural tags). A
tool whose parameters' schema xgrammar refuses is still served, its arguments held to any JSON object
(output_grammar).
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

from jinja2 import Environment, meta

from reuse_server.api.protocol import ChatCompletionRequest, ResponseFormat, ToolDefinition
from reuse_server.engine.sampling_params import InvalidRequest
from reuse_server.engine.structured_output import Constraint, Grammar, GrammarCompiler

logger = logging.getLogger("reuse_server.api")

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
NO_PARAMETERS = {"type": "object", "properties": {}}
ANY_ARGUMENTS = {"type": "object"}  # any JSON object: a tool whose own schema cannot be compiled

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>")


# ---------------------------------------------------------------- the request's tools


@dataclass(frozen=True)
class ToolSettings:
    """What a request asks of tool calling. `function`: the one function tool_choice names, if it names one."""

    tools: tuple[dict, ...]  # the definitions, known fields only: the same prompt text on every step
    choice: Literal["none", "auto", "required", "function"]
    parallel: bool
    function: str | None = None
    cache_control: dict | None = None  # a breakpoint after the tool definitions (any tool marked: the longest ttl)
    # tools whose parameters' schema xgrammar refuses: their calls' arguments are held to any JSON object
    # (output_grammar); the prompt still shows the schema as sent
    free_arguments: frozenset[str] = frozenset()

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def schemas(self) -> dict[str, dict]:
        """Each tool's arguments schema as decoding holds calls to it."""
        return {t["function"]["name"]: ANY_ARGUMENTS if t["function"]["name"] in self.free_arguments
                else t["function"].get("parameters") or NO_PARAMETERS for t in self.tools}


def tool_settings(body: ChatCompletionRequest) -> ToolSettings:
    """Check tools and tool_choice together; InvalidRequest for what no model could honour."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise InvalidRequest(f"tools: the function name {duplicate!r} is defined more than once.", "tools")
    choice, function = body.tool_choice or "auto", None
    if not isinstance(choice, str):
        choice, function = "function", choice.function.name
        if function not in names:
            raise InvalidRequest(f"tool_choice names the function {function!r}, which is not among the tools.",
                                 "tool_choice")
    if choice == "required" and not tools:
        raise InvalidRequest("tool_choice 'required' needs tools.", "tool_choice")
    marks = [t.cache_control.model_dump() for t in tools if t.cache_control is not None]
    mark = max(marks, key=lambda m: m["ttl"] == "1h") if marks else None
    return ToolSettings(tuple(_as_sent(t) for t in tools), choice, body.parallel_tool_calls is not False, function,
                        mark)


def _as_sent(tool: ToolDefinition) -> dict:
    return tool.model_dump(exclude_none=True, by_alias=True, exclude={"cache_control"})


# ---------------------------------------------------------------- rendering


@lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    env = Environment()
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except Exception:  # a template jinja cannot parse fails later, when it is rendered
        return frozenset()


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template takes `tools` and renders assistant tool calls itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when given tools
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return False
    return "tools" in _template_variables(template) and "tool_calls" in template


def tools_block(tools: tuple[dict, ...]) -> str:
    return TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_POSTAMBLE


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (the form the grammar enforces)."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CALL_CLOSE}'


def _parts(content: Any) -> list[dict]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def _arguments_object(arguments: str, where: str) -> Any:
    try:
        return json.loads(arguments, strict=False)
    except json.JSONDecodeError:
        raise InvalidRequest(f"{where}: the arguments are not valid JSON.", "messages") from None


def for_template(tokenizer: Any, messages: list[dict], settings: ToolSettings) -> tuple[list[dict], dict]:
    """The conversation (`chat_template.conversation`'s dicts, with OpenAI's tool_calls and tool_call_id)
    as the chat template takes it, and the extra template arguments."""
    if template_renders_tools(tokenizer):
        out = []
        for i, m in enumerate(messages):
            if m.get("tool_calls"):
                calls = [{"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments_object(c["function"]["arguments"], f"messages[{i}].tool_calls[{j}]")}}
                    for j, c in enumerate(m["tool_calls"])]
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out, ({"tools": list(settings.tools)} if settings.tools else {})
    return _fallback(messages, settings), {}


def _fallback(messages: list[dict], settings: ToolSettings) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            for j, c in enumerate(calls):
                _arguments_object(c["function"]["arguments"], f"messages[{i}].tool_calls[{j}]")
            m["content"] = _parts(m.get("content")) + [
                {"type": "text", "text": call_text(c["function"]["name"], c["function"]["arguments"])} for c in calls]
        elif m["role"] == "tool":
            m["content"] = ([{"type": "text", "text": RESPONSE_OPEN}] + _parts(m.get("content"))
                            + [{"type": "text", "text": RESPONSE_CLOSE}])
        out.append(m)
    if settings.tools:
        block = {"type": "text", "text": tools_block(settings.tools)}
        if settings.cache_control is not None:
            block["cache_control"] = settings.cache_control
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": [block] + _parts(out[0].get("content"))}
        else:
            out.insert(0, {"role": "system", "content": [block]})
    return out


# ---------------------------------------------------------------- decoding constraints


def _call_tag(name: str, parameters: dict) -> dict:
    return {"type": "tag", "begin": f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
            # one space at most between JSON tokens: a small model left free loops on whitespace
            "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
            "end": f"}}\n{CALL_CLOSE}"}


def output_format(settings: ToolSettings, answer: dict | None = None) -> dict | None:
    """The xgrammar structural-tag format for a request's output, or None when tools add no constraint.
    `answer`: the format of a reply that is not a call (response_format), if any."""
    if not settings.parses_calls:
        return None
    schemas = settings.schemas()
    if settings.choice == "function":
        return _call_tag(settings.function, schemas[settings.function])
    tags = [_call_tag(name, params) for name, params in schemas.items()]
    calls_only = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                  "stop_after_first": not settings.parallel}
    if settings.choice == "required":
        return calls_only
    if answer is not None:  # either the structured answer or calls
        return {"type": "or", "elements": [answer, calls_only]}
    return {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags,
            "stop_after_first": not settings.parallel}


def response_format_spec(response_format: ResponseFormat | None) -> dict | None:
    """response_format as an xgrammar format (json_schema), or None for free text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    return {"type": "json_schema", "json_schema": response_format.json_schema.schema_}


def _tag_constraint(tag: dict) -> Constraint:
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": tag}), "tools")


def output_constraint(settings: ToolSettings | None, response_format: ResponseFormat | None) -> Constraint | None:
    """The constraint a request's output is decoded under, or None."""
    answer = response_format_spec(response_format)
    tag = output_format(settings, answer) if settings is not None else None
    if tag is not None:
        return _tag_constraint(tag)
    if answer is None:
        return None
    kind = "json_object" if response_format.type == "json_object" else "json_schema"
    return Constraint(kind, json.dumps(answer["json_schema"]), "response_format")


def output_grammar(grammars: GrammarCompiler, settings: ToolSettings | None,
                   response_format: ResponseFormat | None) -> Grammar | None:
    """The compiled grammar a request's output is decoded under (None: unconstrained). A tool whose parameters'
    schema xgrammar refuses is not a 400: real clients send schemas it cannot compile (a `pattern` with `\\p{L}`,
    `\\b` or a lookbehind, draft-04's boolean `exclusiveMinimum`), and the request must still be served, so
    that tool's arguments are held to any JSON object instead, with a warning. A response_format that cannot
    be compiled is still a 400: the client asked for that shape of answer."""
    constraint = output_constraint(settings, response_format)
    if constraint is None:
        return None
    try:
        return grammars.compile(constraint)
    except InvalidRequest:
        refused = _refused_tools(grammars, settings) if settings is not None and settings.parses_calls else {}
        if not refused:
            raise
    for name, reason in refused.items():
        _warn_free_arguments(name, reason)
    return grammars.compile(output_constraint(replace(settings, free_arguments=frozenset(refused)), response_format))


def _refused_tools(grammars: GrammarCompiler, settings: ToolSettings) -> dict[str, str]:
    """{name: xgrammar's reason} of the tools whose call, alone, cannot be compiled (run only once the whole
    output's grammar failed, so a request whose tools all compile pays nothing)."""
    refused = {}
    for name, schema in settings.schemas().items():
        try:
            grammars.compile(_tag_constraint(_call_tag(name, schema)))
        except InvalidRequest as exc:
            refused[name] = exc.message
    return refused


@lru_cache(maxsize=256)
def _warn_free_arguments(name: str, reason: str) -> None:
    """Logged once per tool and reason (cached): an agent sends the same tools on every step."""
    logger.warning("tool %r: its parameters' schema cannot be compiled (%s); its calls' arguments are held to "
                   "any JSON object instead", name, reason)


# ---------------------------------------------------------------- reading calls back


class ControlCharEscaper:
    """Escapes the control characters (U+0000-U+001F) that stand raw inside the strings of JSON text, which
    JSON forbids: grammars for length-bounded strings let a model write them. Text outside strings passes
    through unchanged, so the model's own formatting is kept. Feed it a text in pieces, in order."""

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                elif ch < " ":
                    ch = json.dumps(ch)[1:-1]
            elif ch == '"':
                self.in_string = True
            out.append(ch)
        return "".join(out)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)


def parse_call(inner: str) -> ParsedCall | None:
    """The call written between the tags, or None if it is not one. The arguments keep the model's own
    text when it is the object the call holds (so a client that sends them back repeats the same tokens)."""
    try:
        obj = json.loads(inner, strict=False)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments, strict=False)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    head = _HEAD.match(inner)
    if head:
        raw = inner[head.end():].rstrip()
        if raw.endswith("}"):
            raw = ControlCharEscaper().feed(raw[:-1].rstrip())
            try:
                if json.loads(raw) == arguments:
                    text = raw
            except json.JSONDecodeError:
                pass
    return ParsedCall(new_call_id(), obj["name"], text)


@dataclass
class ParsedAnswer:
    """An answer's content and calls. `cut`: calls dropped because the answer ended inside them (max_tokens
    or a stop string cut them); they are never content. `ends_in_calls`: no content after the last call."""

    content: str | None
    calls: list[ParsedCall]
    cut: int = 0
    ends_in_calls: bool = False

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, bool(self.calls), self.ends_in_calls)


def _cut_open_tag(tail: str) -> bool:
    """Whether the end of a cut answer is the beginning of a call's opening tag (and nothing else)."""
    tail = tail.strip()
    return bool(tail) and CALL_OPEN.startswith(tail) and tail != CALL_OPEN


def parse_tool_calls(text: str, truncated: bool = False) -> ParsedAnswer:
    """Content and calls of a whole answer: every well-formed `<tool_call>` block becomes a call and leaves
    the content; a block the answer ended inside is dropped (so is a cut opening tag when the answer was
    `truncated`, i.e. ran out of tokens); any other text stays content. Content is None when only calls
    were written. Reads the same as ToolCallStream, piece by piece."""
    calls: list[ParsedCall] = []
    content, last, cut = [], 0, 0
    since_call = ""  # content after the last call
    for block in _BLOCK.finditer(text):
        closed = text.endswith(CALL_CLOSE, 0, block.end())
        call = parse_call(block.group(1))
        if call is None and closed:
            continue  # not a call: stays content
        piece = text[last:block.start()]
        content.append(piece)
        since_call += piece
        if call is None:
            cut += 1
        else:
            calls.append(call)
            since_call = ""
        last = block.end()
    tail = text[last:]
    if truncated and _cut_open_tag(tail):
        cut += 1
        tail = ""
    if not calls and not cut:
        return ParsedAnswer(text, [])
    content.append(tail)
    since_call += tail
    return ParsedAnswer("".join(content).strip() or None, calls, cut, bool(calls) and not since_call.strip())


def finish_reason(reason: str | None, called: bool, ends_in_calls: bool = False) -> str | None:
    """OpenAI's "tool_calls" for an answer that made calls and ended by itself, or ran out of tokens after
    its last complete call (the cut one dropped)."""
    if called and (reason == "stop" or (reason == "length" and ends_in_calls)):
        return "tool_calls"
    return reason


@dataclass
class StreamEvent:
    kind: Literal["content", "call", "arguments"]
    text: str = ""  # content, or an arguments fragment
    index: int = 0  # the call's index in this answer
    id: str = ""
    name: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCallStream:
    """Reads calls out of an answer as it streams: content until a call begins; each call (its id and name,
    then its arguments) once its closing tag has come. A call is held back whole because the answer may end
    inside it (max_tokens): a cut call is dropped, never sent half, never sent as content. Text that may be
    the start of a tag, and whitespace that may only lead up to a call, wait for the next text."""

    state: Literal["text", "call"] = "text"
    buffer: str = ""
    calls: int = 0
    cut: int = 0
    content_sent: bool = False
    content_after_call: bool = False
    events: list[StreamEvent] = field(default_factory=list)

    @property
    def ends_in_calls(self) -> bool:
        return self.calls > 0 and not self.content_after_call

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, self.calls > 0, self.ends_in_calls)

    def feed(self, text: str) -> list[StreamEvent]:
        self.buffer += text
        self.events = []
        while self._step():
            pass
        return self.events

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """Whatever is held back once the answer has ended (`truncated`: it ran out of tokens)."""
        self.events = []
        if self.state == "text":
            if truncated and _cut_open_tag(self.buffer):
                self.cut += 1
            else:
                self._content(self.buffer.rstrip())
        else:
            call = parse_call(self.buffer)  # complete JSON whose closing tag was cut still is a call
            if call is not None:
                self._call(call)
            else:
                self.cut += 1
        self.buffer = ""
        self.state = "text"
        return self.events

    def _content(self, text: str) -> None:
        if not self.content_sent:
            text = text.lstrip()
        if text:
            self.content_sent = True
            self.content_after_call = self.calls > 0
            self.events.append(StreamEvent("content", text))

    def _call(self, call: ParsedCall) -> None:
        self.events.append(StreamEvent("call", index=self.calls, id=call.id, name=call.name))
        self.events.append(StreamEvent("arguments", call.arguments, index=self.calls))
        self.calls += 1
        self.content_after_call = False

    def _step(self) -> bool:
        """Consume what the buffer decides; True if the state changed (and the loop should go on)."""
        if self.state == "text":
            at = self.buffer.find(CALL_OPEN)
            if at < 0:
                keep = _partial_suffix(self.buffer, CALL_OPEN)
                ready = self.buffer[:len(self.buffer) - keep]
                body = ready.rstrip()  # whitespace waits: it may only lead up to a call
                self._content(body)
                self.buffer = ready[len(body):] + self.buffer[len(self.buffer) - keep:]
                return False
            self._content(self.buffer[:at].rstrip())
            self.buffer = self.buffer[at + len(CALL_OPEN):]
            self.state = "call"
            return True
        close = self.buffer.find(CALL_CLOSE)
        if close < 0:
            return False
        call = parse_call(self.buffer[:close])
        if call is not None:
            self._call(call)
        else:  # a whole block that is not a call stays content, as parse_tool_calls leaves it
            self._content(CALL_OPEN + self.buffer[:close + len(CALL_CLOSE)])
        self.buffer = self.buffer[close + len(CALL_CLOSE):]
        self.state = "text"
        return True
