"""POST /v1/cache/chunks: compute documents' KV and file it in the chunk index before any question arrives,
so the first prompt that quotes them (anywhere, in any order) can blend them instead of computing them.

Each chunk is tokenized exactly as a chat text part or a --blend-separator piece is (alone, no special
tokens), so its key matches theirs. The chunks of one call run concurrently, each as an engine precompute
(LLMEngine.precompute): a prefill like any other that registers its chunk and samples nothing.
"""
from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing

from blend.chunking import encode
from fastapi import Request
from fastapi.responses import Response

from reuse_server.api.app_state import app_state
from reuse_server.api.chat_template import user_turn_opening
from reuse_server.api.generation import check_model, until_done_or_disconnected
from reuse_server.api.protocol import CacheChunksRequest, CacheChunksResponse, CachedChunk
from reuse_server.engine.client import EngineClient
from reuse_server.engine.outputs import RequestOutput
from reuse_server.engine.sampling_params import CacheOptions, InvalidRequest


def check_lengths(chunks: list[list[int]], limit: int, opening: int) -> None:
    """A chunk is computed as a prompt of its own, after the chat template's opening; it must leave the one
    token a prompt needs."""
    room = limit - opening - 1
    for i, ids in enumerate(chunks):
        if len(ids) > room:
            raise InvalidRequest(
                f"chunks[{i}] has {len(ids)} tokens, but this model's maximum context length is {limit} tokens "
                f"and the chat template's opening takes {opening}, so a chunk can have at most {room}.",
                f"chunks[{i}]", "context_length_exceeded")


def start_precompute(engine: EngineClient, opening: list[int], token_ids: list[int], salt: str | None,
                     tenant: str | None, deadline: float | None):
    # blend=False: a chunk already in the index would otherwise be blended from itself, and a blended
    # chunk is neither registered again nor reported as present.
    options = CacheOptions(chunk_spans=[(len(opening), len(token_ids))], cache_salt=salt, tenant=tenant, blend=False)
    return engine.precompute(f"chunk-{uuid.uuid4().hex}", opening + token_ids, options, deadline)


async def last_output(stream) -> RequestOutput:
    last = None
    async with aclosing(stream):
        async for out in stream:
            last = out
    return last


async def precompute_all(streams: list) -> list[RequestOutput]:
    tasks = [asyncio.ensure_future(last_output(stream)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:  # one failed or the client left: stop the rest too (their requests are aborted)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def tokenize_chunks(tokenizer, texts: list[str]) -> tuple[list[list[int]], list[int]]:
    """Each document's tokens, and the chat template's opening that precedes them."""
    return [list(encode(tokenizer, text)) for text in texts], user_turn_opening(tokenizer)


def chunk_result(index: int, num_tokens: int, out: RequestOutput | None, min_tokens: int) -> CachedChunk:
    if out is None:
        return CachedChunk(index=index, tokens=num_tokens, stored_tokens=0, already_cached=False,
                           skipped=f"shorter than {min_tokens} tokens")
    present = out.chunk_tokens_present > 0
    skipped = None
    if not present and not out.chunk_tokens_stored:
        skipped = "no free KV cache blocks to hold it"
    return CachedChunk(index=index, tokens=num_tokens, stored_tokens=out.chunk_tokens_stored,
                       already_cached=present, skipped=skipped)


async def precompute_chunks(engine: EngineClient, body: CacheChunksRequest, request: Request) -> Response:
    check_model(body, engine.model_names)
    tenant = request.state.tenant
    tokenizing = app_state(request).tokenizing
    chunks, opening = await tokenizing.run(tokenize_chunks, tokenizing.tokenizer_for(tenant), body.chunks)
    check_lengths(chunks, engine.max_model_len, len(opening))  # before any KV block is touched
    min_tokens = engine.config.blend_min_tokens
    todo = [i for i, ids in enumerate(chunks) if len(ids) >= min_tokens]
    engine.check_queue_room(len(todo))  # then every chunk is submitted at once, nothing let in between
    streams = [start_precompute(engine, opening, chunks[i], body.cache_salt, tenant, request.state.deadline)
               for i in todo]
    try:
        finals = await until_done_or_disconnected(precompute_all(streams), request)
    finally:  # a stream whose task never ran was never opened: abort it here
        for stream in streams:
            stream.close()
    by_index = dict(zip(todo, finals))
    results = [chunk_result(i, len(ids), by_index.get(i), min_tokens) for i, ids in enumerate(chunks)]
    response = CacheChunksResponse(model=engine.model_id, stored_tokens=sum(r.stored_tokens for r in results),
                                   chunks=results)
    return Response(response.model_dump_json(), media_type="application/json")
