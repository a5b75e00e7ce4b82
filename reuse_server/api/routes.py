"""The HTTP endpoints; each hands off to the module that does the work."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from reuse_server.api.cache_chunks import precompute_chunks
from reuse_server.api.cache_prefetch import prefetch
from reuse_server.api.cache_stats import cache_stats
from reuse_server.api.chat import create_chat_completion
from reuse_server.api.completions import create_completion
from reuse_server.api.errors import ClientDisconnected, ModelNotFound, internal_error
from reuse_server.api.protocol import (CacheChunksRequest, CachePrefetchRequest, ChatCompletionRequest,
                                       CompletionRequest, ModelCard, ModelList)
from reuse_server.sampling_params import InvalidRequest

router = APIRouter()
_STARTED = int(time.time())


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request) -> Response:
    engine = request.app.state.engine
    listing = ModelList(data=[ModelCard(id=engine.model_id, created=_STARTED, max_model_len=engine.max_model_len)])
    return Response(listing.model_dump_json(), media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _answer(create_completion, body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _answer(create_chat_completion, body, request)


@router.post("/v1/cache/chunks")
async def cache_chunks(body: CacheChunksRequest, request: Request) -> Response:
    return await _answer(precompute_chunks, body, request)


@router.post("/v1/cache/prefetch")
async def cache_prefetch(body: CachePrefetchRequest, request: Request) -> Response:
    return await _answer(prefetch, body, request)


@router.get("/v1/cache/stats")
async def stats(request: Request) -> Response:
    return Response(cache_stats(request.app.state.engine), media_type="application/json")


async def _answer(handler, body, request: Request) -> Response:
    try:
        return await handler(request.app.state.engine, body, request)
    except (InvalidRequest, ModelNotFound, ClientDisconnected):
        raise  # the app's handlers turn these into 4xx
    except Exception:
        # Answered here rather than by an app-level handler, which Starlette re-raises (a second traceback).
        return internal_error(request)
