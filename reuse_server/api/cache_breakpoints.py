"""Where a client's `cache_control` marks fall in the rendered prompt.

The chat template renders every text part as its own reusable chunk, in the order of the messages and their
parts (`blend.chunking.render_chat_chunks`: a part with text is exactly one chunk span), so the breakpoint of a
marked part is the end of its span: the prompt up to and including that block, as Anthropic counts a prefix.
The tools' mark rides on the tool definitions' own text part where the server renders them (api/tools.py's
fallback, both bundled models); a template that renders tools itself places them out of sight, and that mark
is dropped. A prompt the template did not render verbatim has no spans: its marks are dropped (logged)."""
from __future__ import annotations

import logging

from reuse_server.engine.sampling_params import InvalidRequest
from reuse_server.kv.pins import CacheBreakpoint

log = logging.getLogger(__name__)

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
TTL_NAMES = {int(v): k for k, v in TTL_SECONDS.items()}
MAX_BREAKPOINTS = 4  # Anthropic's limit: more cache_control blocks is a 400


def part_marks(messages: list[dict]) -> list[dict | None]:
    """The cache_control mark (or None) of each text part that becomes a chunk, in chunk order."""
    marks: list[dict | None] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            if content:
                marks.append(None)
        elif isinstance(content, list):
            marks += [part.get("cache_control") for part in content if part.get("text")]
    return marks


def breakpoints(messages: list[dict], spans: list[tuple[int, int]]) -> tuple[CacheBreakpoint, ...]:
    """The breakpoints of the marked parts of `messages` (as the template took them), from the prompt's
    reusable chunk spans; InvalidRequest past MAX_BREAKPOINTS."""
    marks = part_marks(messages)
    marked = [(i, m) for i, m in enumerate(marks) if m is not None]
    if not marked:
        return ()
    if len(marked) > MAX_BREAKPOINTS:
        raise InvalidRequest(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                             f"Found {len(marked)}.", "cache_control")
    if len(spans) != len(marks):
        log.info("prompt not chunked by the chat template: %d cache_control breakpoint(s) not placed", len(marked))
        return ()
    return tuple(CacheBreakpoint(spans[i][0] + spans[i][1], TTL_SECONDS[m.get("ttl") or "5m"]) for i, m in marked)
