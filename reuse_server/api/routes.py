"""The HTTP endpoints; each hands off to the module that does the work. Every status a route can answer is
declared with its body, so the OpenAPI schema (/openapi.json) describes the real responses (a fuzz test holds
the server to it)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from reuse_server.api.app_state import app_state
from reuse_server.api.auth import cache_viewer, require_admin, require_tenant
from reuse_server.api.cache_chunks import precompute_chunks
from reuse_server.api.cache_prefetch import prefetch
from reuse_server.api.cache_stats import cache_stats
from reuse_server.api.cache_viewer import CacheViewer
from reuse_server.api.chat_completions import create_chat_completion
from reuse_server.api.completions import create_completion
from reuse_server.api.errors import (RETRY_AFTER_DRAINING, RETRY_AFTER_STALLED, SERVICE_ERRORS, ClientDisconnected,
                                     ModelNotFound, NotFound, internal_error)
from reuse_server.api.messages import count_tokens, create_message
from reuse_server.api.messages_protocol import (AnthropicErrorResponse, CountTokensRequest, CountTokensResponse,
                                                MessageResponse, MessagesRequest)
from reuse_server.api.protocol import (CacheChunksRequest, CacheChunksResponse, CachePrefetchRequest,
                                       CachePrefetchResponse, ChatCompletionRequest,
                                       ChatCompletionResponse, CompletionRequest, CompletionResponse, ErrorResponse,
                                       HealthStatus, ModelCard, ModelList)
from reuse_server.api.responses import create_response, delete_response, get_response
from reuse_server.api.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest
from reuse_server.api.render import render_chat, render_completion
from reuse_server.api.worker_info import ModelInfo, RankLoad, ServerInfo, load, model_info, server_info
from reuse_server.engine.client import EngineClient
from reuse_server.engine.sampling_params import InvalidRequest

_STARTED = int(time.time())


def _error(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
_UNAUTHORIZED = {401: _error("No valid API key (only when the server has keys).")}
_ERRORS = {
    400: _error("The request is invalid (an OpenAI-style error names the field)."),
    **_UNAUTHORIZED,
    404: _error("The model is not the one served."),
    408: _error("The request ran past --request-timeout and was aborted."),
    429: {**_error("Too many requests are waiting (--max-waiting)."), "headers": _RETRY_AFTER},
    500: _error("An internal error."),
    503: {**_error("The server is shutting down, or its engine has stalled or stopped."), "headers": _RETRY_AFTER},
}
# One event of the stream (OpenAPI 3.1 describes a text/event-stream by its events): its data is a JSON chunk
# (the completion's shape, object "chat.completion.chunk" or "text_completion"), an error object, or [DONE].
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                         "properties": {"data": {"type": "string"}}}}}


def _generation(model, errors: dict = _ERRORS) -> dict:
    return {200: {"model": model, "description": "The response; with stream=true, Server-Sent Events.",
                  "content": _SSE}, **errors}


# Anthropic's routes answer errors in Anthropic's shape (api/errors.py), with the same statuses.
_ANTHROPIC_ERRORS = {status: {**entry, "model": AnthropicErrorResponse} for status, entry in _ERRORS.items()}


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_tenant)])


@router.get("/health", response_model=HealthStatus,
            responses={503: {"model": HealthStatus,
                             "description": "Not serving: shutting down, engine stalled or stopped.",
                             "headers": _RETRY_AFTER}})
async def health(request: Request) -> JSONResponse:
    engine = app_state(request).engine
    reason = engine.unavailable_reason()
    if reason is None:
        return JSONResponse(HealthStatus(status="ok").model_dump(exclude_none=True))
    if engine.dead_reason is None and engine.stalled_reason is not None:
        return JSONResponse(HealthStatus(status="stalled", reason=reason).model_dump(), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_STALLED)})
    if engine.draining and engine.dead_reason is None:
        return JSONResponse(HealthStatus(status="draining", reason=reason).model_dump(), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_DRAINING)})
    return JSONResponse(HealthStatus(status="dead", reason=reason).model_dump(), status_code=503)


# What a load-balancing gateway asks of a worker (api/worker_info.py); open like /health.
@router.get("/server_info", response_model=ServerInfo)
async def get_server_info(request: Request) -> ServerInfo:
    return server_info(app_state(request).engine)


@router.get("/model_info", response_model=ModelInfo)
async def get_model_info(request: Request) -> ModelInfo:
    return model_info(app_state(request).engine)


@router.get("/get_load", response_model=list[RankLoad])
async def get_load(request: Request) -> list[RankLoad]:
    return load(app_state(request).engine)


@v1.get("/models", response_model=ModelList, responses=_UNAUTHORIZED)
async def models(request: Request) -> Response:
    engine = app_state(request).engine
    # as vLLM lists them: every served name, the id first; the --model alias is accepted but not listed
    listing = ModelList(data=[ModelCard(id=name, created=_STARTED, max_model_len=engine.max_model_len)
                              for name in engine.model_names.served])
    return Response(listing.model_dump_json(), media_type="application/json")


@router.get("/metrics", dependencies=[Depends(require_admin)], response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus metrics."},
                       401: _error("No admin API key (only when the server has one).")})
async def metrics(request: Request) -> Response:
    return Response(app_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@v1.post("/completions", response_model=None, responses=_generation(CompletionResponse))
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _answer(create_completion, body, request)


@v1.post("/chat/completions", response_model=None, responses=_generation(ChatCompletionResponse))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _answer(create_chat_completion, body, request)


@v1.post("/messages", response_model=None, responses=_generation(MessageResponse, _ANTHROPIC_ERRORS))
async def messages(body: MessagesRequest, request: Request) -> Response:
    return await _answer(create_message, body, request)


@v1.post("/messages/count_tokens", response_model=None,
         responses={200: {"model": CountTokensResponse, "description": "The prompt's length in tokens."},
                    **_ANTHROPIC_ERRORS})
async def messages_count_tokens(body: CountTokensRequest, request: Request) -> Response:
    return await _answer(count_tokens, body, request)


@v1.post("/responses", response_model=None, responses=_generation(ResponseObject))
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await _answer(create_response, body, request)


_STORED = {200: {"model": ResponseObject, "description": "The stored response."}, **_UNAUTHORIZED,
           404: _error("No stored response with this id for this API key.")}


@v1.get("/responses/{response_id}", response_model=None, responses=_STORED)
async def retrieve_response(response_id: str, request: Request) -> Response:
    return await get_response(request, response_id)


@v1.delete("/responses/{response_id}", response_model=None,
           responses={**_STORED, 200: {"model": DeletedResponse, "description": "Deleted."}})
async def remove_response(response_id: str, request: Request) -> Response:
    return await delete_response(request, response_id)
# vLLM's render endpoints (api/render.py): the prompt's token ids, for a KV-aware router
_RENDERED = {200: {"content": {"application/json": {"schema": {"type": ["object", "array"]}}},
                   "description": "The prompt's token ids."}, **_ERRORS}


@v1.post("/completions/render", response_model=None, responses=_RENDERED)
async def completions_render(body: CompletionRequest, request: Request) -> Response:
    return await _answer(render_completion, body, request)


@v1.post("/chat/completions/render", response_model=None, responses=_RENDERED)
async def chat_completions_render(body: ChatCompletionRequest, request: Request) -> Response:
    return await _answer(render_chat, body, request)


@v1.post("/cache/chunks", response_model=None,
         responses={200: {"model": CacheChunksResponse, "description": "What was stored."}, **_ERRORS})
async def cache_chunks(body: CacheChunksRequest, request: Request) -> Response:
    return await _answer(precompute_chunks, body, request)


@v1.post("/cache/prefetch", response_model=None,
         responses={200: {"model": CachePrefetchResponse, "description": "How much of the prompt is now resident."},
                    **_ERRORS})
async def cache_prefetch(body: CachePrefetchRequest, request: Request) -> Response:
    return await _answer(prefetch, body, request)


@router.get("/v1/cache/stats", response_class=Response,
            responses={200: {"content": {"application/json": {"schema": {"type": "object"}}},
                             "description": "What the device pool and each tier below it hold; the prompt-cache "
                                            "pins of every tenant (the admin key) or the caller's own (a tenant "
                                            "key)."},
                       401: _error("No admin or tenant API key (only when the server has keys).")})
async def stats(request: Request, viewer: CacheViewer = Depends(cache_viewer)) -> Response:
    return Response(cache_stats(app_state(request).engine, viewer), media_type="application/json")


# a door's handler: the engine, the request's parsed body, the request
Handler = Callable[[EngineClient, Any, Request], Awaitable[Response]]


async def _answer(handler: Handler, body: BaseModel, request: Request) -> Response:
    state = app_state(request)
    engine = state.engine
    timeout = state.settings.request_timeout
    request.state.deadline = asyncio.get_running_loop().time() + timeout if timeout else None
    try:
        engine.check_queue_room(0)  # refused at once while shutting down or dead, before tokenizing anything
        return await handler(engine, body, request)
    except (InvalidRequest, ModelNotFound, NotFound, ClientDisconnected, *SERVICE_ERRORS):
        raise  # the app's handlers turn these into 4xx (and 503s that say why)
    except Exception:
        # Answered here rather than by an app-level handler, which Starlette re-raises (a second traceback).
        return internal_error(request)


router.include_router(v1)
