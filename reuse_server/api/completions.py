"""POST /v1/completions."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from blend.chunking import split_by_separator, tokenize_chunks

from reuse_server.api.app_state import app_state
from reuse_server.api.generation import (SSEResponse, cache_options, check_common, check_model, collect,
                                         compile_constraint, generate_choices, sampling_params, sse_events,
                                         usage_from)
from reuse_server.api.keepalive import CommentLine, keepalive_for, kept_alive
from reuse_server.api.prompt_chunks import PromptChunks, from_chunks, leading_special_tokens
from reuse_server.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from reuse_server.engine.client import EngineClient
from reuse_server.engine.outputs import RequestOutput, TokenLogprob
from reuse_server.engine.sampling_params import InvalidRequest


def completion_prompt(tokenizer, prompt: str | list, separator: str | None = None) -> PromptChunks:
    """A text prompt is one piece, or with the server's --blend-separator the pieces between separators,
    each tokenized alone and reusable; a token-id prompt is taken as is, with no chunks."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise InvalidRequest(
                f"Batched prompts are not supported: got {len(prompt)} prompts; send one prompt per request.",
                "prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("The prompt is empty.", "prompt")
        return PromptChunks(list(prompt), [])
    pieces = split_by_separator(prompt, separator) if separator else [prompt] if prompt else []
    if not pieces:
        raise InvalidRequest("The prompt is empty.", "prompt")
    if separator:
        return from_chunks(tokenize_chunks(tokenizer, pieces), prefix=leading_special_tokens(tokenizer))
    return PromptChunks(list(tokenizer.encode(prompt)), [])


async def completion_prompt_ids(engine: EngineClient, body: CompletionRequest, request: Request) -> PromptChunks:
    """The prompt's token ids and chunk spans, tokenized on a worker thread."""
    tokenizing = app_state(request).tokenizing
    return await tokenizing.run(completion_prompt, tokenizing.tokenizer_for(request.state.tenant), body.prompt,
                                engine.config.blend_separator)


def completion_logprobs(logprobs: list[TokenLogprob], text_offset: int = 0) -> CompletionLogprobs:
    """OpenAI's legacy logprobs; text offsets count from the start of the generated text."""
    result = CompletionLogprobs()
    for lp in logprobs:
        result.tokens.append(lp.token)
        result.token_logprobs.append(lp.logprob)
        result.top_logprobs.append({text: value for _, text, value in lp.top})
        result.text_offset.append(text_offset)
        text_offset += len(lp.token)
    return result


async def create_completion(engine: EngineClient, body: CompletionRequest, request: Request) -> Response:
    check_model(body, engine.model_names)
    check_common(body)
    if body.echo:
        raise InvalidRequest("echo is not supported.", "echo")
    if body.suffix:
        raise InvalidRequest("suffix is not supported.", "suffix")
    if body.best_of not in (None, 1):
        raise InvalidRequest(f"Only best_of=1 is supported, got best_of={body.best_of}.", "best_of")
    prompt_ids, chunk_spans = await completion_prompt_ids(engine, body, request)
    params = sampling_params(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs)
    params.grammar = await compile_constraint(request, None, body.response_format)
    params = engine.validate_prompt(prompt_ids, params)  # before any 200 goes out and before any KV block is touched

    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = body.n or 1
    outputs = generate_choices(engine, request_id, prompt_ids, params,
                               cache_options(body, chunk_spans, request.state.tenant), n, request.state.deadline)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = completion_chunks(outputs, n, request_id, created, engine.model_id, include_usage,
                                   params.logprobs is not None)
        return SSEResponse(kept_alive(sse_events(chunks, outputs), keepalive_for(CommentLine, request)))

    choices = []
    per_choice = await collect(outputs, n, request)
    for i, results in enumerate(per_choice):
        logprobs = None
        if params.logprobs is not None:
            logprobs = completion_logprobs([lp for out in results for lp in out.logprobs or []])
        choices.append(CompletionChoice(index=i, text="".join(out.new_text for out in results), logprobs=logprobs,
                                        finish_reason=results[-1].finish_reason))
    response = CompletionResponse(id=request_id, created=created, model=engine.model_id, choices=choices,
                                  usage=usage_from([results[-1] for results in per_choice]))
    return Response(response.model_dump_json(), media_type="application/json")


async def completion_chunks(outputs: AsyncIterator[tuple[int, RequestOutput]], n: int, request_id: str,
                            created: int, model: str, include_usage: bool,
                            want_logprobs: bool) -> AsyncIterator[CompletionResponse]:
    def chunk(i: int, text: str, finish_reason: str | None = None, logprobs=None) -> CompletionResponse:
        return CompletionResponse(id=request_id, created=created, model=model, choices=[
            CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish_reason)])

    lasts: dict[int, RequestOutput] = {}
    offsets = [0] * n
    async for i, out in outputs:
        lasts[i] = out
        if out.new_text or out.logprobs:
            logprobs = completion_logprobs(out.logprobs or [], offsets[i]) if want_logprobs else None
            offsets[i] += sum(len(lp.token) for lp in out.logprobs or [])
            yield chunk(i, out.new_text, logprobs=logprobs)
        if out.finished:
            yield chunk(i, "", finish_reason=out.finish_reason)
    if include_usage and lasts:
        yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                 usage=usage_from(list(lasts.values())))
