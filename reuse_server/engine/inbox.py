"""What the event loop hands the engine thread (async_engine.py): one frozen message per kind of work.

The engine thread matches on the message's class, so a message that is none of these is refused by the
submitter (AsyncEngine._submit raises TypeError on the caller's thread) instead of reaching the engine loop,
where an exception would stop the engine. A submission (Add, Precompute, Prefetch) counts as waiting from the
moment it is queued (--max-waiting), with its prompt's tokens; an Abort counts as nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from reuse_server.engine.sampling_params import CacheOptions, SamplingParams


@dataclass(frozen=True)
class Add:
    """A generation request, validated already (AsyncEngine.validate_prompt): LLMEngine.add."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    options: CacheOptions


@dataclass(frozen=True)
class Precompute:
    """A chunk precompute (POST /v1/cache/chunks): LLMEngine.precompute."""
    request_id: str
    prompt_token_ids: list[int]
    options: CacheOptions


@dataclass(frozen=True)
class Prefetch:
    """Pull a prompt's cached blocks up into the pool (POST /v1/cache/prefetch): LLMEngine.prefetch."""
    request_id: str
    prompt_token_ids: list[int]
    options: CacheOptions


@dataclass(frozen=True)
class Abort:
    """End a request (its consumer stopped listening, or it timed out): LLMEngine.abort."""
    request_id: str


Submission = Add | Precompute | Prefetch
InboxMessage = Add | Precompute | Prefetch | Abort
