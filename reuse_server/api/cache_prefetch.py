"""POST /v1/cache/prefetch: pull a prompt's cached blocks from the tiers below the device pool (host RAM,
disk, Redis) up into it, ahead of the request that will use them, and say how many of its tokens are now
resident. The engine admits the prompt's blocks (which pulls them up and files them in the radix tree) and
releases them at once, computing nothing (LLMEngine.prefetch)."""
from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from reuse_server.api.app_state import app_state
from reuse_server.api.cache_chunks import last_output
from reuse_server.api.chat_template import render_chat_prompt
from reuse_server.api.completions import completion_prompt
from reuse_server.api.generation import check_model, until_done_or_disconnected
from reuse_server.api.protocol import CachePrefetchRequest, CachePrefetchResponse, TierTokens
from reuse_server.engine.client import EngineClient
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams


async def prefetch(engine: EngineClient, body: CachePrefetchRequest, request: Request) -> Response:
    check_model(body, engine.model_names)
    tenant = request.state.tenant
    tokenizing = app_state(request).tokenizing
    tokenizer = tokenizing.tokenizer_for(tenant)
    if body.messages is not None:
        prompt_ids, _ = await tokenizing.run(render_chat_prompt, tokenizer, body.messages)
    else:
        prompt_ids, _ = await tokenizing.run(completion_prompt, tokenizer, body.prompt, engine.config.blend_separator)
    engine.validate_prompt(prompt_ids, SamplingParams(max_tokens=1))  # before any KV block is touched
    engine.check_queue_room(1)
    stream = engine.prefetch(f"prefetch-{uuid.uuid4().hex}", prompt_ids,
                             CacheOptions(cache_salt=body.cache_salt, tenant=tenant), request.state.deadline)
    try:
        out = await until_done_or_disconnected(last_output(stream), request)
    finally:
        stream.close()
    response = CachePrefetchResponse(model=engine.model_id, prompt_tokens=len(prompt_ids),
                                     resident_tokens=out.cached_tokens, tier_tokens=TierTokens(**out.tier_tokens))
    return Response(response.model_dump_json(), media_type="application/json")
