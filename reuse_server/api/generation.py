"""Plumbing shared by both endpoints: request fields -> engine arguments, running a request's choices to
completion (aborting them if the client leaves), and Server-Sent Events framing.

A request with n choices is n engine requests with the same prompt: prefill dedup and the prefix cache make
the prompt's KV computed once (the first choice computes it, the others wait a step and hit it)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from reuse_server.api.app_state import app_state
from reuse_server.api.errors import SERVICE_ERRORS, ClientDisconnected, ModelNotFound, error_body, service_error
from reuse_server.api.protocol import GenerationRequest, PromptTokensDetails, ResponseFormat, TierTokens, Usage
from reuse_server.api.tools import ToolSettings, output_grammar
from reuse_server.engine.client import EngineClient
from reuse_server.engine.model_names import ModelNames
from reuse_server.engine.outputs import Admission, RequestOutput
from reuse_server.engine.sampling_params import CacheOptions, InvalidRequest, SamplingParams
from reuse_server.engine.structured_output import Grammar

logger = logging.getLogger("reuse_server.api")

DISCONNECT_POLL_SECONDS = 0.2
T = TypeVar("T")


def check_model(body: BaseModel, names: ModelNames) -> None:
    """404 unless the request names no model or one the server answers to (engine/model_names.py)."""
    if body.model is not None and not names.accepts(body.model):
        raise ModelNotFound(body.model, names.id)


MAX_CHOICES = 16


def check_common(body: GenerationRequest) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}, got n={body.n}.", "n")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true.", "stream_options")


def sampling_params(body: GenerationRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's sampling parameters (range-checked with the prompt by the engine's validate_prompt)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    defaults = SamplingParams()
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=defaults.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=token_biases(body.logit_bias),
    )
    return params


async def compile_constraint(request: Request, tools: ToolSettings | None,
                             response_format: ResponseFormat | None) -> Grammar | None:
    """The compiled grammar for a request's tools and response_format (None: unconstrained; tools.output_grammar),
    compiled on a worker thread so that neither the event loop nor the engine waits for it; the server's
    GrammarCompiler caches it."""
    return await asyncio.to_thread(output_grammar, app_state(request).grammars, tools, response_format)


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys, hence strings) with integer keys."""
    out = {}
    for key, bias in (logit_bias or {}).items():
        try:
            out[int(key)] = float(bias)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
    return out


def cache_options(body: GenerationRequest, chunk_spans: list[tuple[int, int]] = (),
                  tenant: str | None = None, breakpoints: list = ()) -> CacheOptions:
    blend = body.kv_blend
    return CacheOptions(
        prefix_cache=body.prefix_cache is not False,
        cache_salt=body.cache_salt,
        tenant=tenant,
        blend=None if blend is None else blend.enabled,
        recompute_ratio=None if blend is None else blend.recompute_ratio,
        chunk_spans=list(chunk_spans),
        breakpoints=list(breakpoints),
    )


def usage_from(lasts: list[RequestOutput]) -> Usage:
    """Usage of a request from its choices' last outputs: the prompt counted once, with the cache figures of
    the choice that computed the most of it; completion tokens summed over the choices."""
    computed = min(lasts, key=lambda out: out.cached_tokens)
    completion = sum(out.num_output_tokens for out in lasts)
    return Usage(
        prompt_tokens=computed.num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=computed.num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=computed.cached_tokens, cache_write_tokens=computed.cache_write_tokens,
            blended_tokens=computed.blended_tokens,
            recomputed_tokens=computed.recomputed_tokens, tier_tokens=TierTokens(**computed.tier_tokens)),
    )


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice. With a seed, choice i samples with seed + i: one seed for all would draw
    the same tokens n times."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i if params.seed + i < 2**64 else params.seed - i)
            for i in range(n)]


def generate_choices(engine: EngineClient, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     options: CacheOptions, n: int, deadline: float | None = None) -> "ChoiceOutputs":
    """Let in and start the n choices of a request at once (nothing else is let in between); their
    outputs as they come, each with its choice index. Raises (429, 503) before anything is queued."""
    engine.check_queue_room(n)
    return ChoiceOutputs([engine.generate(request_id if n == 1 else f"{request_id}-{i}", prompt_ids, p, options,
                                          deadline)
                          for i, p in enumerate(choice_params(params, n))])


class ChoiceOutputs:
    """(index, output) of a request's choices as they come. Closing it aborts every unfinished choice, even
    if nobody ever iterated it (a client gone before the response started)."""

    def __init__(self, streams: list) -> None:
        self.streams = streams
        self._merged = interleave(streams)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._merged

    async def admitted(self) -> Admission:
        """Once the first choice is let into the engine's running batch (the one that computes the prompt)."""
        return await self.streams[0].admitted()

    async def aclose(self) -> None:
        await self._merged.aclose()
        for stream in self.streams:
            await stream.aclose()


async def interleave(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) of several output streams as they come; an error in any is raised here. Closing this
    iterator closes every stream, which aborts every unfinished choice."""
    if len(streams) == 1:  # no tasks or queue for the usual case
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def admitted_first(admitted: Awaitable[Admission], items: AsyncIterator[T]) -> AsyncIterator[Admission | T]:
    """`items`, after the request's Admission if it comes first: it does, by a whole prefill for a long prompt,
    unless the request ends before it is admitted (its error is then raised here). Closing this closes
    `items` (a read of it still pending is cancelled first)."""
    waiting = asyncio.ensure_future(admitted)
    first = asyncio.ensure_future(_next_of(items))
    try:
        await asyncio.wait({waiting, first}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():  # the engine sends the admission before the step that computes the prompt
            yield waiting.result()
        try:
            item = await first
        except StopAsyncIteration:
            return
        yield item
        async for item in items:
            yield item
    finally:
        for task in (waiting, first):
            task.cancel()
        await asyncio.gather(waiting, first, return_exceptions=True)
        await items.aclose()


async def _next_of(items: AsyncIterator[T]) -> T:
    return await anext(items)


async def until_done_or_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """Await `awaitable`, polling the connection meanwhile: uvicorn does not cancel a handler whose client
    left, so without this a gone client would keep its sequences (and KV blocks) busy to the end.
    On a disconnect the work is cancelled and ClientDisconnected raised."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def collect(outputs: AsyncIterator[tuple[int, RequestOutput]], n: int,
                  request: Request) -> list[list[RequestOutput]]:
    """All outputs of each of a request's n choices; they are aborted if the client leaves first."""

    async def drain() -> list[list[RequestOutput]]:
        per_choice: list[list[RequestOutput]] = [[] for _ in range(n)]
        async for i, out in outputs:
            per_choice[i].append(out)
        return per_choice

    try:
        return await until_done_or_disconnected(drain(), request)
    finally:
        await outputs.aclose()  # the engine aborts a request whose iterator closes before it finished


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_events(chunks: AsyncIterator[BaseModel], outputs: AsyncIterator) -> AsyncIterator[str]:
    """Frame chunk models as SSE and end with [DONE]. An error after the 200 has gone out can only be
    reported in-band, as an OpenAI-style error event."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except InvalidRequest as exc:
        yield sse(error_body(exc.message, "invalid_request_error", exc.param, exc.code))
    except SERVICE_ERRORS as exc:  # timed out, engine died, server shutting down
        yield sse(service_error(exc).body())
    except Exception:
        logger.exception("Error while streaming a response")
        yield sse(error_body("The server had an internal error while streaming the response.", "server_error"))
    finally:
        await chunks.aclose()
        await outputs.aclose()
    yield SSE_DONE


def sse_event(name: str, payload: BaseModel | dict) -> str:
    """One Server-Sent Event with a name, as Anthropic's and the Responses API's streams frame them."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"event: {name}\ndata: {data}\n\n"


# (status, message, OpenAI error type) -> the (name, payload) of a dialect's in-band error event
ErrorEvent = Callable[[int, str, str], tuple[str, dict]]


async def named_sse_events(events: AsyncIterator[tuple[str, BaseModel | dict]], outputs: AsyncIterator,
                           error_event: ErrorEvent) -> AsyncIterator[str]:
    """Frame (name, payload) events as SSE (no [DONE]: these dialects end with their own last event). An error
    after the 200 has gone out is reported in-band, in the dialect's shape."""
    try:
        async for name, payload in events:
            yield sse_event(name, payload)
    except InvalidRequest as exc:
        yield sse_event(*error_event(400, exc.message, "invalid_request_error"))
    except SERVICE_ERRORS as exc:
        error = service_error(exc)
        yield sse_event(*error_event(error.status, error.message, error.type))
    except Exception:
        logger.exception("Error while streaming a response")
        yield sse_event(*error_event(500, "The server had an internal error while streaming the response.",
                                     "server_error"))
    finally:
        await events.aclose()
        await outputs.aclose()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client disconnect (which cancels the
    send, not necessarily our generator) still closes the engine iterator and aborts the request."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send) -> None:
        async with aclosing(self.body_iterator):
            await super().stream_response(send)
