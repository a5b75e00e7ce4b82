"""POST /v1/chat/completions."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from reuse_server.api.chat_template import render_chat_prompt
from reuse_server.api.generation import (SSEResponse, cache_options, check_common, check_model, collect,
                                         generate_choices, sampling_params, sse_events, usage_from)
from reuse_server.api.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatTokenLogprob, DeltaMessage, TopLogprob)
from reuse_server.outputs import RequestOutput, TokenLogprob
from reuse_server.sampling_params import InvalidRequest


def chat_logprobs(logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(content=[
        ChatTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()), top_logprobs=[
            TopLogprob(token=text, logprob=value, bytes=list(text.encode())) for _, text, value in lp.top])
        for lp in logprobs])


def check_unsupported(body: ChatCompletionRequest) -> None:
    """Reject what this server cannot honour rather than ignore it: a client asking for tool calls or JSON
    output would otherwise take plain text for the model's choice."""
    if body.tools and body.tool_choice != "none":
        raise InvalidRequest("Tool calls are not supported by this server; send no tools (or tool_choice "
                             "'none').", "tools")
    kind = (body.response_format or {}).get("type", "text")
    if kind != "text":
        raise InvalidRequest(f"response_format {kind!r} is not supported; only 'text'.", "response_format")


def requested_logprobs(body: ChatCompletionRequest) -> int | None:
    """Chat's (logprobs: bool, top_logprobs: int) as the engine's single 'how many alternatives' number."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true.", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


async def create_chat_completion(engine, body: ChatCompletionRequest, request: Request) -> Response:
    check_model(body, engine.model_id)
    check_common(body)
    check_unsupported(body)
    logprobs = requested_logprobs(body)
    tokenizing = request.app.state.tokenizing
    prompt_ids, chunk_spans = await tokenizing.run(render_chat_prompt, tokenizing.tokenizer_for(request.state.tenant),
                                                   body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # OpenAI's default for chat: whatever room the context leaves
        max_tokens = max(1, engine.max_model_len - len(prompt_ids))
    params = sampling_params(body, max_tokens, logprobs)
    engine.validate_prompt(prompt_ids, params)  # before any 200 goes out and before any KV block is touched

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = body.n or 1
    outputs = generate_choices(engine, request_id, prompt_ids, params,
                               cache_options(body, chunk_spans, request.state.tenant), n, request.state.deadline)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = chat_chunks(outputs, n, request_id, created, engine.model_id, include_usage, logprobs is not None)
        return SSEResponse(sse_events(chunks, outputs))

    choices = []
    per_choice = await collect(outputs, n, request)
    for i, results in enumerate(per_choice):
        choice_logprobs = None
        if logprobs is not None:
            choice_logprobs = chat_logprobs([lp for out in results for lp in out.logprobs or []])
        choices.append(ChatChoice(index=i, message=AssistantMessage(content="".join(out.new_text for out in results)),
                                  logprobs=choice_logprobs, finish_reason=results[-1].finish_reason))
    response = ChatCompletionResponse(id=request_id, created=created, model=engine.model_id, choices=choices,
                                      usage=usage_from([results[-1] for results in per_choice]))
    return Response(response.model_dump_json(), media_type="application/json")


async def chat_chunks(outputs: AsyncIterator[tuple[int, RequestOutput]], n: int, request_id: str, created: int,
                      model: str, include_usage: bool, want_logprobs: bool) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(i: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[
            ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])

    for i in range(n):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    lasts: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        lasts[i] = out
        if out.new_text or out.logprobs:
            logprobs = chat_logprobs(out.logprobs or []) if want_logprobs else None
            yield chunk(i, DeltaMessage(content=out.new_text), logprobs=logprobs)
        if out.finished:
            yield chunk(i, DeltaMessage(), finish_reason=out.finish_reason)
    if include_usage and lasts:
        yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                  usage=usage_from(list(lasts.values())))
