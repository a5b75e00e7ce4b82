"""One request's state inside the engine: its tokens, its blocks, how far its KV is computed."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from reuse_server.sampling_params import CacheOptions, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache: CacheOptions = field(default_factory=CacheOptions)
    arrival: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None

    # KV state. block_table[i] holds positions i*bs .. (i+1)*bs-1. Blocks in `owned` are ours alone
    # (allocated, not in the tree); the others belong to the radix tree and stay alive through `node`'s lock.
    block_table: list[int] = field(default_factory=list)
    owned: set[int] = field(default_factory=set)
    node: object | None = None  # locked radix node covering the tree-owned prefix of block_table
    num_computed: int = 0  # tokens whose KV is in the pool
    num_inserted_blocks: int = 0  # leading full blocks already handed to the radix tree
    approximate: bool = False  # KV derived from blending: filed under the approximate namespace
    approximate_key: bytes = b""  # that namespace (one per blending setting)
    unpublishable: bool = False  # approximate KV that could not be moved out of the exact tree

    # usage accounting (first admission only: a preempted request's recompute is our cost, not the client's hit)
    cached_tokens: int | None = None
    counted: bool = False  # usage added to the engine's counters
    blended_tokens: int = 0
    recomputed_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    blend_plan: object | None = None  # BlendPlan while a blended prefill is scheduled
    reused_starts: set[int] = field(default_factory=set)  # chunk starts whose KV came from the chunk index
    chunk_tokens_stored: int = 0
    chunk_tokens_present: int = 0
    skipped: int = 0  # times passed over by cache-aware ordering (starvation guard)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    @property
    def uses_prefix_cache(self) -> bool:
        return self.cache.prefix_cache

    @property
    def extra_key(self) -> bytes:
        # The namespace folded into block hashes: tenant, then salt. Tenant ids all have one length, so
        # (tenant, salt) pairs never collide; without API keys there is no tenant and the key is as before.
        tenant = self.cache.tenant.encode() if self.cache.tenant else b""
        return tenant + (self.cache.cache_salt.encode() if self.cache.cache_salt else b"")
