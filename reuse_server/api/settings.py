"""What the HTTP layer is configured with besides the engine (the CLI fills it from flags)."""
from __future__ import annotations

from dataclasses import dataclass, field

from reuse_server.api.api_keys import ApiKeys
from reuse_server.api.response_store import ResponseStore
from reuse_server.api.tokenizing import DEFAULT_THREADS

# Seconds of silence before a stream sends a keepalive (api/keepalive.py): under Claude Code's byte watchdog
# (10 s at least; it runs against Anthropic's own URL) and its 20 s "stalled" notice, far under proxies' 60 s.
DEFAULT_SSE_KEEPALIVE = 5.0


@dataclass
class ServerSettings:
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # none: the routes are open, requests have no tenant
    request_timeout: float | None = None  # seconds from arrival; past it the request is aborted (408)
    tokenizer_threads: int = DEFAULT_THREADS
    sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE  # None: streams send nothing in their silences
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored responses (POST /v1/responses)
