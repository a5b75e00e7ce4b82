"""POST /v1/completions/render and /v1/chat/completions/render (vLLM's render endpoints): the prompt's token ids
exactly as /v1/completions and /v1/chat/completions build them (the same code: chat template, tools, content
parts, --blend-separator), without generating. A KV-aware router (vllm-router `kv_aware`) asks a worker for them
and hashes them into blocks to find the replica that holds the most of the prompt. Nothing is queued and no KV
block is touched."""
from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from reuse_server.api.chat import chat_prompt
from reuse_server.api.completions import completion_prompt_ids
from reuse_server.api.generation import check_model
from reuse_server.api.protocol import ChatCompletionRequest, CompletionRequest
from reuse_server.engine.client import EngineClient


async def render_completion(engine: EngineClient, body: CompletionRequest, request: Request) -> JSONResponse:
    """A list with one entry per prompt (vLLM renders batches; we take one prompt a request)."""
    check_model(body, engine.model_names)
    prompt_ids, _ = await completion_prompt_ids(engine, body, request)
    return JSONResponse([{"request_id": f"cmpl-{uuid.uuid4().hex}", "token_ids": prompt_ids, "sampling_params": {},
                          "model": engine.model_id}])


async def render_chat(engine: EngineClient, body: ChatCompletionRequest, request: Request) -> JSONResponse:
    check_model(body, engine.model_names)
    prompt_ids, _, _ = await chat_prompt(body, request)
    return JSONResponse({"request_id": f"chatcmpl-{uuid.uuid4().hex}", "token_ids": prompt_ids,
                         "model": engine.model_id})
