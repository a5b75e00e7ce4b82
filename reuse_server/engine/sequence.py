"""One request inside the engine, in parts that each have one writer:
- the request itself (id, prompt, sampling params, cache `options`, arrival, whether it generates): fixed
  when it arrives;
- `output_ids` and `finish_reason`: the scheduler (Scheduler.update appends tokens and ends it; abort);
- `kv` (kv.kv_sequence.KVState): the block manager alone (which sees the sequence as a KVSequence): its
  blocks, how far its KV is computed, what it handed the tree;
- `queue` (QueueState): the scheduler alone: waiting or running, times passed over, preemptions;
- `usage` (Usage): the scheduler alone: what the client is told about reuse (the engine reads it);
- `detokenizer`: made by the engine when the request arrives, fed by the scheduler's update;
- `sampling` (sampler.SamplerState): the sampler alone: the seeded generator, the grammar matcher;
- `blend` (blend_job.BlendJob): the blender alone: a blended prefill in progress (None otherwise).
Nothing about a request is kept in a dict keyed by its id elsewhere; when the sequence goes, all of it goes."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reuse_server.engine.detokenizer import IncrementalDetokenizer
from reuse_server.engine.sampler import SamplerState
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.kv.kv_sequence import KVState

if TYPE_CHECKING:
    from reuse_server.engine.blend_job import BlendJob


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class QueueState:
    """Written by the Scheduler only."""

    status: SeqStatus = SeqStatus.WAITING
    skipped: int = 0  # times passed over by cache-aware ordering (starvation guard)
    preemptions: int = 0


@dataclass
class Usage:
    """Written by the scheduler only (admission, the step's update). Counted at the first admission: a
    preempted request's recompute is our cost, not the client's hit."""

    cached_tokens: int | None = None  # prompt tokens not computed from scratch (prefix hits + blended)
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of those, loaded from each tier below the pool
    blended_tokens: int = 0  # reused from the chunk index and not recomputed
    recomputed_tokens: int = 0  # reused from the chunk index but recomputed by selection
    recomputed_positions: tuple[int, ...] = ()  # ... and their prompt positions
    counted: bool = False  # its prompt's KV was complete once: reported, and added to the engine's counters
    first_token_time: float | None = None
    chunk_tokens_stored: int = 0  # chunks this request filed in the chunk index
    chunk_tokens_present: int = 0  # chunks it would have filed that were there already
    cache_write_tokens: int = 0  # prompt tokens it computed into whole blocks the cache keeps (OpenAI's writes)
    breakpoint_write_tokens: dict[int, int] = field(default_factory=dict)  # {ttl s: tokens} (Anthropic's writes)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    options: CacheOptions = field(default_factory=CacheOptions)
    arrival: float = field(default_factory=time.monotonic)
    # False: a chunk precompute, which computes its prompt, registers its chunks and ends (no token sampled)
    generates: bool = True

    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    kv: KVState = field(default_factory=KVState)
    queue: QueueState = field(default_factory=QueueState)
    usage: Usage = field(default_factory=Usage)
    detokenizer: IncrementalDetokenizer | None = None
    sampling: SamplerState = field(default_factory=SamplerState)
    blend: "BlendJob | None" = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        return self.kv.num_computed

    @property
    def block_table(self) -> list[int]:
        return self.kv.block_table

    @property
    def status(self) -> SeqStatus:
        return self.queue.status

    @property
    def is_prefilling(self) -> bool:
        return self.kv.num_computed < self.num_tokens - 1

    @property
    def uses_prefix_cache(self) -> bool:
        return self.options.prefix_cache

    @property
    def namespace(self) -> bytes:
        """What keeps this request's cached KV apart from other requests' (see CacheOptions.namespace)."""
        return self.options.namespace
