"""POST /v1/chat/completions."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from reuse_server.api.chat_template import render_chat_prompt
from reuse_server.api.generation import (SSEResponse, cache_options, check_common, check_model, collect,
                                         compile_constraint, generate_choices, sampling_params, sse_events,
                                         usage_from)
from reuse_server.api.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatTokenLogprob, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                       FunctionCall, ToolCall, TopLogprob)
from reuse_server.api.tools import (StreamEvent, ToolCallStream, finish_reason, output_constraint,
                                    parse_tool_calls, tool_settings)
from reuse_server.engine.outputs import RequestOutput, TokenLogprob
from reuse_server.engine.sampling_params import InvalidRequest


def chat_logprobs(logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(content=[
        ChatTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()), top_logprobs=[
            TopLogprob(token=text, logprob=value, bytes=list(text.encode())) for _, text, value in lp.top])
        for lp in logprobs])


def requested_logprobs(body: ChatCompletionRequest) -> int | None:
    """Chat's (logprobs: bool, top_logprobs: int) as the engine's single 'how many alternatives' number."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true.", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


async def chat_prompt(body: ChatCompletionRequest, request: Request):
    """The prompt's token ids and chunk spans as the chat template renders the messages (tools and earlier
    calls included), tokenized on a worker thread, and the request's tool settings."""
    tools = tool_settings(body)
    tokenizing = request.app.state.tokenizing
    prompt_ids, chunk_spans = await tokenizing.run(render_chat_prompt, tokenizing.tokenizer_for(request.state.tenant),
                                                   body.messages, tools)
    return prompt_ids, chunk_spans, tools


async def create_chat_completion(engine, body: ChatCompletionRequest, request: Request) -> Response:
    check_model(body, engine.model_id)
    check_common(body)
    logprobs = requested_logprobs(body)
    prompt_ids, chunk_spans, tools = await chat_prompt(body, request)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # OpenAI's default for chat: whatever room the context leaves
        max_tokens = max(1, engine.max_model_len - len(prompt_ids))
    params = sampling_params(body, max_tokens, logprobs)
    params.grammar = await compile_constraint(request, output_constraint(tools, body.response_format))
    engine.validate_prompt(prompt_ids, params)  # before any 200 goes out and before any KV block is touched

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = body.n or 1
    outputs = generate_choices(engine, request_id, prompt_ids, params,
                               cache_options(body, chunk_spans, request.state.tenant), n, request.state.deadline)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = chat_chunks(outputs, n, request_id, created, engine.model_id, include_usage, logprobs is not None,
                             tools.parses_calls)
        return SSEResponse(sse_events(chunks, outputs))

    choices = []
    per_choice = await collect(outputs, n, request)
    for i, results in enumerate(per_choice):
        choice_logprobs = None
        if logprobs is not None:
            choice_logprobs = chat_logprobs([lp for out in results for lp in out.logprobs or []])
        text = "".join(out.new_text for out in results)
        content, calls = parse_tool_calls(text) if tools.parses_calls else (text, [])
        message = AssistantMessage(content=content, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)
        choices.append(ChatChoice(index=i, message=message, logprobs=choice_logprobs,
                                  finish_reason=finish_reason(results[-1].finish_reason, bool(calls))))
    response = ChatCompletionResponse(id=request_id, created=created, model=engine.model_id, choices=choices,
                                      usage=usage_from([results[-1] for results in per_choice]))
    return Response(response.model_dump_json(), media_type="application/json")


def delta_of(event: StreamEvent) -> DeltaMessage:
    if event.kind == "content":
        return DeltaMessage(content=event.text)
    if event.kind == "call":
        return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, id=event.id, type="function",
                                                      function=DeltaFunctionCall(name=event.name, arguments=""))])
    return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))])


async def chat_chunks(outputs: AsyncIterator[tuple[int, RequestOutput]], n: int, request_id: str, created: int,
                      model: str, include_usage: bool, want_logprobs: bool,
                      parse_calls: bool = False) -> AsyncIterator[ChatCompletionChunk]:
    """The stream's chunks. With `parse_calls`, each choice's text goes through a ToolCallStream, which turns
    tool calls into `delta.tool_calls` as OpenAI streams them."""
    def chunk(i: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[
            ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])

    for i in range(n):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    lasts: dict[int, RequestOutput] = {}
    calls = [ToolCallStream() for _ in range(n)] if parse_calls else None
    async for i, out in outputs:
        lasts[i] = out
        if calls is None:
            if out.new_text or out.logprobs:
                logprobs = chat_logprobs(out.logprobs or []) if want_logprobs else None
                yield chunk(i, DeltaMessage(content=out.new_text), logprobs=logprobs)
            if out.finished:
                yield chunk(i, DeltaMessage(), finish_reason=out.finish_reason)
            continue
        logprobs = chat_logprobs(out.logprobs) if want_logprobs and out.logprobs else None
        events = calls[i].feed(out.new_text) + (calls[i].finish() if out.finished else [])
        for event in events:
            yield chunk(i, delta_of(event), logprobs=logprobs)
            logprobs = None
        if logprobs is not None:  # tokens held back from the text still report their logprobs
            yield chunk(i, DeltaMessage(), logprobs=logprobs)
        if out.finished:
            yield chunk(i, DeltaMessage(), finish_reason=finish_reason(out.finish_reason, calls[i].calls > 0))
    if include_usage and lasts:
        yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                  usage=usage_from(list(lasts.values())))
