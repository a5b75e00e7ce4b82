"""The one chat path under every dialect: chat completions, Responses and Messages translate their request
into a ChatCompletionRequest (messages with tool calls and results, tools, tool_choice, response_format,
sampling and cache fields), and this module renders, tokenizes, constrains and runs it, and reads the
answers back (tool calls parsed out of them). Each dialect only writes the result in its own wire format, so
blending, tools, constrained decoding and tenants behave the same on all three."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, NamedTuple

from fastapi import Request

from reuse_server.api.app_state import app_state
from reuse_server.api.chat_template import render_chat_prompt, render_marked_chat_prompt
from reuse_server.api.generation import (ChoiceOutputs, cache_options, check_common, check_model, collect,
                                         compile_constraint, generate_choices, sampling_params)
from reuse_server.api.prompt_chunks import PromptChunks
from reuse_server.api.protocol import ChatCompletionRequest
from reuse_server.api.tools import (ParsedAnswer, StreamEvent, ToolCallStream, ToolSettings, parse_tool_calls,
                                    tool_settings)
from reuse_server.engine.client import EngineClient
from reuse_server.engine.outputs import RequestOutput
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.kv.pins import CacheBreakpoint

logger = logging.getLogger("reuse_server.api")

# (tokenizer, messages, tools) -> the prompt; runs on a tokenizing thread. The default renders the whole chat;
# a stored conversation's continuation starts from the exact tokens of its earlier turns (api/responses.py).
PromptRenderer = Callable[..., PromptChunks]


@dataclass
class PreparedChat:
    """A checked chat request, ready to run: nothing is scheduled yet and no KV block is held."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolSettings
    cache: CacheOptions
    n: int
    chunk_spans: list[tuple[int, int]] = field(default_factory=list)

    def start(self, engine: EngineClient, request: Request) -> ChoiceOutputs:
        """Queue the request (429/503 raised here, before anything is queued)."""
        return generate_choices(engine, self.request_id, self.prompt_ids, self.params, self.cache, self.n,
                                request.state.deadline)


async def chat_prompt(body: ChatCompletionRequest, request: Request,
                      render: PromptRenderer = render_chat_prompt) -> tuple[list[int], list, ToolSettings]:
    """The prompt's token ids and chunk spans as the chat template renders the messages (tools and earlier
    calls included), tokenized on a worker thread, and the request's tool settings: what every generating
    route and the render endpoint (api/render.py) build."""
    prompt, _, tools = await marked_chat_prompt(body, request, render)
    return prompt.token_ids, prompt.chunk_spans, tools


async def marked_chat_prompt(body: ChatCompletionRequest, request: Request, render: PromptRenderer = render_chat_prompt
                             ) -> tuple[PromptChunks, tuple[CacheBreakpoint, ...], ToolSettings]:
    """chat_prompt's prompt, with the cache breakpoints the client's cache_control marks set in it."""
    tools = tool_settings(body)
    tokenizing = app_state(request).tokenizing
    prompt, breakpoints = await tokenizing.run(render_marked_chat_prompt, render,
                                               tokenizing.tokenizer_for(request.state.tenant), body.messages, tools)
    return prompt, breakpoints, tools


async def prepare_chat(engine: EngineClient, body: ChatCompletionRequest, request: Request, request_id: str,
                       logprobs: int | None = None, render: PromptRenderer = render_chat_prompt) -> PreparedChat:
    """Validate, render and tokenize (on a worker thread), compile the output constraint; raises
    InvalidRequest (a 400) for anything the engine could not run."""
    check_model(body, engine.model_names)
    check_common(body)
    prompt, breakpoints, tools = await marked_chat_prompt(body, request, render)
    prompt_ids, chunk_spans = prompt.token_ids, prompt.chunk_spans
    # None (OpenAI's default for chat): whatever room the context leaves; the engine fits any limit to that room
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, logprobs)
    params.grammar = await compile_constraint(request, tools, body.response_format)
    params = engine.validate_prompt(prompt_ids, params)  # before any 200 goes out and before any KV block is touched
    options = cache_options(body, chunk_spans, request.state.tenant, breakpoints)
    return PreparedChat(request_id, prompt_ids, params, tools, options, body.n or 1, list(chunk_spans))


def _log_cut(request_id: str, cut: int, kept: int, reason: str | None) -> None:
    if cut:
        logger.info("request %s: dropped %d tool call(s) cut short (finish %s); %d complete call(s) returned",
                    request_id, cut, reason, kept)


@dataclass
class Answer:
    """One choice's whole answer: its text read into content and calls, and its engine outputs."""

    outputs: list[RequestOutput]
    parsed: ParsedAnswer

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's: "stop", "length", "tool_calls" or "abort"."""
        return self.parsed.finish_reason(self.last.finish_reason)

    @property
    def token_ids(self) -> list[int]:
        return [t for out in self.outputs for t in out.new_token_ids]


def read_answer(chat: PreparedChat, outputs: list[RequestOutput]) -> Answer:
    text = "".join(out.new_text for out in outputs)
    if not chat.tools.parses_calls:
        return Answer(outputs, ParsedAnswer(text, []))
    parsed = parse_tool_calls(text, truncated=outputs[-1].finish_reason == "length")
    _log_cut(chat.request_id, parsed.cut, len(parsed.calls), outputs[-1].finish_reason)
    return Answer(outputs, parsed)


async def whole_answers(chat: PreparedChat, outputs: ChoiceOutputs, request: Request) -> list[Answer]:
    """Every choice's answer once all have finished (aborted if the client leaves first)."""
    return [read_answer(chat, results) for results in await collect(outputs, chat.n, request)]


class AnswerStep(NamedTuple):
    """One engine output of a streamed choice, read: the content and calls it completes (calls come whole,
    api/tools.ToolCallStream) and, on the last one, OpenAI's finish reason."""

    index: int
    out: RequestOutput
    events: list[StreamEvent]
    finish_reason: str | None


async def answer_steps(chat: PreparedChat, outputs: ChoiceOutputs) -> AsyncIterator[AnswerStep]:
    streams = [ToolCallStream() for _ in range(chat.n)] if chat.tools.parses_calls else None
    async for i, out in outputs:
        if streams is None:
            events = [StreamEvent("content", out.new_text)] if out.new_text else []
            yield AnswerStep(i, out, events, out.finish_reason if out.finished else None)
            continue
        stream = streams[i]
        events = stream.feed(out.new_text)
        if out.finished:
            events += stream.finish(truncated=out.finish_reason == "length")
            _log_cut(chat.request_id, stream.cut, stream.calls, out.finish_reason)
        yield AnswerStep(i, out, events, stream.finish_reason(out.finish_reason) if out.finished else None)
