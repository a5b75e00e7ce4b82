"""Anthropic's prompt caching on the Messages door: the `cache_control` marks carried onto the chat request's
text parts (where api/cache_breakpoints.py places them in the prompt), the top-level automatic breakpoint, and
the cache figures of `usage`."""
from __future__ import annotations

from reuse_server.api.cache_breakpoints import TTL_NAMES
from reuse_server.api.messages_protocol import MessagesRequest, TextBlock
from reuse_server.engine.outputs import Admission, RequestOutput


def marked(part: dict, block) -> dict:
    """A chat text part carrying the block's cache_control mark, if it has one."""
    mark = getattr(block, "cache_control", None)
    return {**part, "cache_control": mark.model_dump()} if mark is not None else part


def tool_result_content(block, text: str) -> str | list[dict]:
    """A tool_result's content for the chat tool message: a marked text part where the block (or a text block
    inside it) carries cache_control, the plain text otherwise."""
    inner = [b for b in block.content if b.cache_control is not None] if isinstance(block.content, list) else []
    mark = block if block.cache_control is not None else (inner[-1] if inner else None)
    if mark is None or not text:
        return text
    return [marked({"type": "text", "text": text}, mark)]


def with_automatic_breakpoint(body: MessagesRequest) -> MessagesRequest:
    """Top-level cache_control (Anthropic's automatic caching): the same mark on the last cacheable block, the
    last text or tool_result block of the last message (one that is marked already keeps its own)."""
    if body.cache_control is None:
        return body
    last = body.messages[-1]
    blocks = [TextBlock(type="text", text=last.content)] if isinstance(last.content, str) else list(last.content)
    at = next((i for i in range(len(blocks) - 1, -1, -1) if blocks[i].type in ("text", "tool_result")), None)
    if at is None or blocks[at].cache_control is not None:
        return body
    blocks[at] = blocks[at].model_copy(update={"cache_control": body.cache_control})
    return body.model_copy(update={"messages": body.messages[:-1] + [last.model_copy(update={"content": blocks})]})


def cache_usage(last: RequestOutput | Admission) -> dict:
    """Anthropic's cache figures: tokens written at breakpoints (computed now, up to the last one) by time to
    live, tokens read from the cache, and the rest of the prompt as input_tokens (which excludes both)."""
    writes = {TTL_NAMES.get(ttl, "5m"): n for ttl, n in last.breakpoint_write_tokens.items()}
    created = sum(writes.values())
    return {"input_tokens": last.num_prompt_tokens - last.cached_tokens - created,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": last.cached_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": writes.get("5m", 0),
                               "ephemeral_1h_input_tokens": writes.get("1h", 0)}}
