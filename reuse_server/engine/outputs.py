"""What the engine reports back for a request, one increment at a time."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token id, text, logprob)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # generated since the previous output of this request
    new_text: str  # detokenized text since the previous output (stop strings already cut)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: int = 0  # prompt tokens served from cache (prefix hits + blended)
    blended_tokens: int = 0  # reused from the chunk index, not recomputed
    recomputed_tokens: int = 0  # reused but recomputed by selection
    recomputed_positions: tuple[int, ...] = ()  # ... their prompt positions (what selection chose)
    logprobs: list[TokenLogprob] | None = None
    chunk_tokens_stored: int = 0  # precompute requests: tokens newly filed in the chunk index
    chunk_tokens_present: int = 0  # ... and tokens of chunks that were already there
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of cached_tokens, those from host/disk/redis
    cache_write_tokens: int = 0  # prompt tokens computed into whole blocks the cache now keeps
    # prompt tokens computed up to the request's last breakpoint, by the breakpoints' time to live in seconds
    breakpoint_write_tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class Admission:
    """A request let into the running batch for the first time: its prompt's match against the cache is known
    and its prefill starts now. A long prompt's first output is a whole prefill away, so a stream that must
    answer before it (Anthropic's message_start carries the prompt's usage) answers from this. Blended tokens
    are not in it: they are known once the prompt is computed (RequestOutput.cached_tokens then adds them)."""

    request_id: str
    num_prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefix match (and the tiers under the pool) served
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of cached_tokens, those from host/disk/redis
    # prompt tokens this request computes up to its last breakpoint, by time to live (as RequestOutput's)
    breakpoint_write_tokens: dict[int, int] = field(default_factory=dict)
