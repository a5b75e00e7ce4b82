"""POST /v1/cache/prefetch: pull a prompt's cached blocks from the tiers below the device pool (host RAM,
disk, Redis) up into it, ahead of the request that will use them, and say how many of its tokens are now
resident. It runs as a request that is admitted (which pulls the blocks up and files them in the radix
tree) and then ends without computing anything."""
from __future__ import annotations

import uuid
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response

from reuse_server.api.chat_template import render_chat_prompt
from reuse_server.api.completions import completion_prompt
from reuse_server.api.errors import ModelNotFound
from reuse_server.api.generation import until_done_or_disconnected
from reuse_server.api.protocol import CachePrefetchRequest, CachePrefetchResponse, TierTokens
from reuse_server.sampling_params import CacheOptions, SamplingParams


async def prefetch(engine, body: CachePrefetchRequest, request: Request) -> Response:
    if body.model is not None and body.model != engine.model_id:
        raise ModelNotFound(body.model, engine.model_id)
    if body.messages is not None:
        prompt_ids, _ = render_chat_prompt(engine.tokenizer, body.messages)
    else:
        prompt_ids, _ = completion_prompt(engine.tokenizer, body.prompt, engine.config.blend_separator)
    params = SamplingParams(max_tokens=1)
    engine.validate_prompt(prompt_ids, params)  # before any KV block is touched

    async def run():
        last = None
        async with aclosing(engine.generate(f"prefetch-{uuid.uuid4().hex}", prompt_ids, params,
                                            CacheOptions(cache_salt=body.cache_salt, prefetch_only=True))) as outs:
            async for out in outs:
                last = out
        return last

    out = await until_done_or_disconnected(run(), request)
    response = CachePrefetchResponse(model=engine.model_id, prompt_tokens=len(prompt_ids),
                                     resident_tokens=out.cached_tokens, tier_tokens=TierTokens(**out.tier_tokens))
    return Response(response.model_dump_json(), media_type="application/json")
