"""What the HTTP layer (api/) may ask of the engine, declared once: the seam between them.

AsyncEngine (async_engine.py) is the one implementation; api/ is written against this Protocol rather than
against AsyncEngine so that what it reaches is this list and nothing more (not the LLMEngine inside, not the
engine thread's internals), as vLLM's entrypoints are written against its EngineClient. Everything here is
safe to call from the event loop: reads of state the engine thread publishes, or submissions to its inbox.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: the engine's modules load torch, and this one is read by every api/ module
    from reuse_server.engine.async_engine import RequestStream
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.model_names import ModelNames
    from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
    from reuse_server.kv.sizing import KVSizing


class EngineClient(Protocol):
    # what the model is
    @property
    def model_id(self) -> str: ...

    @property
    def model_names(self) -> ModelNames: ...

    @property
    def model_architecture(self) -> str:
        """The Hugging Face model_type (llama, gemma3_text)."""

    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer (the project wraps none)

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def sizing(self) -> KVSizing: ...

    # state, for /health, /server_info, /get_load and /v1/cache/stats
    def snapshot(self) -> dict: ...

    @property
    def kv_events(self) -> dict | None:
        """How routers subscribe to this server's KV events (kv/events.py describe()), None without them."""

    @property
    def num_requests(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_waiting_tokens(self) -> int: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def stalled_reason(self) -> str | None: ...

    @property
    def draining(self) -> bool: ...

    def unavailable_reason(self) -> str | None: ...

    # lifecycle (the app's lifespan)
    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    # requests: validated, let into the queue, then submitted, with no await between the queue check and the
    # submission
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams: ...

    def check_queue_room(self, count: int = 1, ahead: int = 0) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 options: CacheOptions | None = None, deadline: float | None = None) -> RequestStream: ...

    def precompute(self, request_id: str, prompt_token_ids: list[int], options: CacheOptions,
                   deadline: float | None = None) -> RequestStream: ...

    def prefetch(self, request_id: str, prompt_token_ids: list[int], options: CacheOptions,
                 deadline: float | None = None) -> RequestStream: ...
