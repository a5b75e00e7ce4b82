"""Where the HTTP layer tokenizes prompts and renders chat templates: on worker threads, not on the event loop.

A long prompt takes seconds to encode; on the loop that would stall every other connection (health checks,
other clients' streams) meanwhile. Hugging Face's fast tokenizers release the GIL while they encode, so the
loop keeps running. A few threads only: tokenizing competes with the engine for the same cores.

With API keys, each tenant tokenizes through its own view of the tokenizer. blend's token cache (token ids of
long texts seen before) is kept per tokenizer object, so a shared one would answer a tenant's long prompt
faster when another tenant had sent the same text: a timing side channel. Views of the most recent tenants
are kept (their caches with them), so the memory this takes stays bounded.

A request being tokenized (queued for a thread or on one) counts as waiting against --max-waiting before its
prompt is tokenized: a flood is refused (429) on arrival, without paying for tokenizing what is refused, and
the prompts held at once stay bounded by the queue.
"""
from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

DEFAULT_THREADS = 2
TENANT_VIEWS = 16  # each holds up to blend.token_cache.DEFAULT_MAX_TOKENS token ids once used


class TenantTokenizer:
    """The shared tokenizer under another identity: every attribute is the tokenizer's own, but caches keyed
    by tokenizer object (blend.token_cache) see a different one."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class Tokenizing:
    def __init__(self, tokenizer: Any, threads: int = DEFAULT_THREADS, tenant_views: int = TENANT_VIEWS,
                 check_queue_room: Callable[..., None] | None = None) -> None:
        """check_queue_room(count, ahead=n): raises (QueueFull) unless `count` more requests may wait besides the
        queue and `n` requests being tokenized (the async engine's); None: no bound."""
        self.tokenizer = tokenizer
        self._check_queue_room = check_queue_room
        self.in_progress = 0  # requests let in and being tokenized
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self._views: OrderedDict[str, TenantTokenizer] = OrderedDict()
        self._max_views = tenant_views

    def tokenizer_for(self, tenant: str | None) -> Any:
        """The tokenizer a request of `tenant` uses (the shared one without API keys)."""
        if tenant is None:
            return self.tokenizer
        view = self._views.pop(tenant, None) or TenantTokenizer(self.tokenizer)
        self._views[tenant] = view
        while len(self._views) > self._max_views:
            self._views.popitem(last=False)
        return view

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a tokenizing thread; refused first (QueueFull) when the queue and the requests being
        tokenized already fill --max-waiting."""
        if self._check_queue_room is not None:
            self._check_queue_room(1, ahead=self.in_progress)
        self.in_progress += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            self.in_progress -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
