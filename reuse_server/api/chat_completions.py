"""POST /v1/chat/completions: OpenAI's chat wire format over the chat path (api/chat.py)."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from reuse_server.api.chat import AnswerStep, PreparedChat, answer_steps, prepare_chat, whole_answers
from reuse_server.api.generation import SSEResponse, sse_events, usage_from
from reuse_server.api.keepalive import CommentLine, keepalive_for, kept_alive
from reuse_server.api.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatTokenLogprob, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                       FunctionCall, ToolCall, TopLogprob)
from reuse_server.api.tools import StreamEvent
from reuse_server.engine.client import EngineClient
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


async def create_chat_completion(engine: EngineClient, body: ChatCompletionRequest, request: Request) -> Response:
    logprobs = requested_logprobs(body)
    chat = await prepare_chat(engine, body, request, f"chatcmpl-{uuid.uuid4().hex}", logprobs)
    created = int(time.time())
    outputs = chat.start(engine, request)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = chat_chunks(chat, answer_steps(chat, outputs), created, engine.model_id, include_usage,
                             logprobs is not None)
        return SSEResponse(kept_alive(sse_events(chunks, outputs), keepalive_for(CommentLine, request)))

    choices = []
    answers = await whole_answers(chat, outputs, request)
    for i, answer in enumerate(answers):
        choice_logprobs = None
        if logprobs is not None:
            choice_logprobs = chat_logprobs([lp for out in answer.outputs for lp in out.logprobs or []])
        message = AssistantMessage(content=answer.parsed.content, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in answer.parsed.calls] or None)
        choices.append(ChatChoice(index=i, message=message, logprobs=choice_logprobs,
                                  finish_reason=answer.finish_reason))
    response = ChatCompletionResponse(id=chat.request_id, created=created, model=engine.model_id, choices=choices,
                                      usage=usage_from([answer.last for answer in answers]))
    return Response(response.model_dump_json(), media_type="application/json")


def delta_of(event: StreamEvent) -> DeltaMessage:
    if event.kind == "content":
        return DeltaMessage(content=event.text)
    if event.kind == "call":
        return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, id=event.id, type="function",
                                                      function=DeltaFunctionCall(name=event.name, arguments=""))])
    return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))])


async def chat_chunks(chat: PreparedChat, steps: AsyncIterator[AnswerStep], created: int, model: str,
                      include_usage: bool, want_logprobs: bool) -> AsyncIterator[ChatCompletionChunk]:
    """The stream's chunks; tool calls as `delta.tool_calls`, the way OpenAI streams them."""
    def chunk(i: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=chat.request_id, created=created, model=model, choices=[
            ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])

    for i in range(chat.n):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    lasts: dict[int, RequestOutput] = {}
    async for step in steps:
        lasts[step.index] = step.out
        logprobs = chat_logprobs(step.out.logprobs) if want_logprobs and step.out.logprobs else None
        for event in step.events:
            yield chunk(step.index, delta_of(event), logprobs=logprobs)
            logprobs = None
        if logprobs is not None:  # tokens held back from the text still report their logprobs
            yield chunk(step.index, DeltaMessage(), logprobs=logprobs)
        if step.out.finished:
            yield chunk(step.index, DeltaMessage(), finish_reason=step.finish_reason)
    if include_usage and lasts:
        yield ChatCompletionChunk(id=chat.request_id, created=created, model=model, choices=[],
                                  usage=usage_from(list(lasts.values())))
