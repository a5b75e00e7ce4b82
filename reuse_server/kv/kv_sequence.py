"""A sequence as the block manager sees it: the KV state it alone writes (KVState) and the few facts of the
request it reads (KVSequence). The engine's Sequence satisfies KVSequence; kv/ names no engine type, so the
block manager sits below the engine that drives it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from reuse_server.kv.pins import CacheBreakpoint


@dataclass
class KVState:
    """Written by the BlockManager only. block_table[i] holds positions i*bs .. (i+1)*bs-1. Blocks in `owned`
    are the sequence's alone (allocated, not in the tree); the others belong to the radix tree and stay alive
    through `node`'s lock."""

    block_table: list[int] = field(default_factory=list)
    owned: set[int] = field(default_factory=set)
    node: object | None = None  # locked radix node covering the tree-owned prefix of block_table
    num_computed: int = 0  # tokens whose KV is in the pool, from position 0 without a gap
    filled: set[int] = field(default_factory=set)  # later block indices already loaded from a tier (after a hole)
    num_published: int = 0  # leading full blocks handed to the radix tree
    approximate: bool = False  # KV derived from blending: filed under `approximate_namespace`
    approximate_namespace: bytes = b""  # where this sequence's blended KV is filed (one per blending setting)
    unpublishable: bool = False  # approximate KV that could not be moved out of the exact namespace
    prompt_hashes: list[bytes] | None = None  # chain hashes of the prompt's full blocks (exact namespace)
    window_from: int = 0  # a hybrid pool: blocks from this index on have window parts this sequence pins


class PinMarks(Protocol):
    """The request's cache options the block manager pins by (Anthropic's `cache_control` breakpoints)."""

    @property
    def tenant(self) -> str | None: ...  # whose pins these are (--max-pinned-share is per tenant)

    @property
    def breakpoints(self) -> Sequence[CacheBreakpoint]: ...


class KVSequence(Protocol):
    """What the block manager reads of a sequence, and its `kv`, which it alone writes (and replaces on
    release)."""

    kv: KVState

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def token_ids(self) -> list[int]: ...  # the prompt, then what was generated

    @property
    def num_tokens(self) -> int: ...

    @property
    def namespace(self) -> bytes: ...  # what keeps its cached KV apart from other requests'

    @property
    def uses_prefix_cache(self) -> bool: ...  # False: it neither reads nor writes the prefix cache

    @property
    def is_prefilling(self) -> bool: ...

    @property
    def options(self) -> PinMarks: ...
