"""The chunk index: position-independent cached KV for chunks of text, held in the radix cache itself.

A chunk is filed in the radix tree under its own namespace ("chunk" + the request's namespace), as if it
were a prompt of its own starting at position 0, and its KV is stored rotated to positions 0..n-1. So its
identity depends only on the chunk's tokens, the model (the cache's identity) and the namespace, never on
what preceded it, and its blocks are held by the same block accounting and evicted in the same LRU
order as every other cached block. Chunks rarely end on a block boundary: the tail is padded with a
token id the model never produces (the vocabulary size), so the last partial block is cached too and
only a whole-chunk match can use it. A lookup may also match only the leading blocks of a chunk
(another chunk with the same beginning): those tokens are reused and the rest computed.

A chunk's KV is filed in one of two forms, each under its own namespace: *alone* (computed right after the
prompt's opening, with no other chunk before it: a precomputed document, or a prompt's first chunk) or *in
context* (computed after other chunks). Blending corrects only the alone form by the model's key shift
(blend/key_shift.py); a lookup prefers it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from radix import MatchResult


@dataclass
class ChunkHit:
    block_ids: list[int]  # chunk-namespace blocks holding positions 0..num_tokens-1 (rounded up to blocks)
    num_tokens: int  # leading tokens of the chunk whose KV is cached
    match: MatchResult  # the block store's lookup: hold() the hit while copying out of these blocks
    alone: bool = True  # the KV was computed with no other chunk before it (see the module docstring)


class BlockStore(Protocol):
    """Where the index's blocks come from and go to: the engine's block manager, the one code that changes
    the radix tree (blend never imports the server; the block manager fits this). The index never touches
    the tree itself: it looks up, holds and releases through the store."""

    def lookup(self, tokens: list[int], namespace: bytes) -> MatchResult:
        """The cached chain of `tokens` (full blocks) in `namespace`, slower tiers' blocks continuing it loaded
        first (so chunks computed before a restart or by another server are found)."""

    def hold(self, match: MatchResult) -> None:
        """Keep a looked-up chain's blocks from being evicted until release_hold(match)."""

    def release_hold(self, match: MatchResult) -> None: ...

    def chain_starts(self, tokens: list[int], namespaces: list[bytes]) -> list[int]:
        """Offsets of `tokens` where a chain filed under one of `namespaces` begins, in order."""

    def store(self, tokens: list[int], fill: Callable[[list[int]], None], namespace: bytes) -> bool:
        """Take blocks for `tokens` (whole blocks), let fill(block_ids) write their KV, file them in the
        tree; False (nothing held) when the pool has no room."""


class ChunkIndex:
    def __init__(self, blocks: BlockStore, block_size: int, pad_token: int, min_tokens: int = 32):
        self.blocks = blocks
        self.block_size = block_size
        self.pad_token = pad_token
        self.min_tokens = min_tokens

    @staticmethod
    def chunk_namespace(namespace: bytes = b"", alone: bool = True) -> bytes:
        """The radix namespace of chunks of a request namespace, in one form."""
        tag = b"chunk\x00" if alone else b"chunk-in-context\x00"  # the tags differ at byte 6, whatever follows
        return tag + namespace

    def padded(self, tokens: list[int]) -> list[int]:
        return list(tokens) + [self.pad_token] * (-len(tokens) % self.block_size)

    def lookup(self, tokens: list[int], namespace: bytes = b"", alone: bool | None = None) -> ChunkHit | None:
        """Cached KV for the longest cached beginning of the chunk, of either form (the alone one on a tie)
        or of the form asked for; None if nothing is cached."""
        if len(tokens) < self.min_tokens:
            return None
        padded = self.padded(tokens)
        best = None
        for form in ((True, False) if alone is None else (alone,)):
            match = self.blocks.lookup(padded, self.chunk_namespace(namespace, form))
            if match.num_tokens and (best is None or match.num_tokens > best.match.num_tokens):
                best = ChunkHit(list(match.block_ids), min(match.num_tokens, len(tokens)), match, form)
        return best

    def starts(self, tokens: list[int], namespace: bytes = b"") -> list[int]:
        """Offsets of `tokens` where a chunk of either form filed in the tree begins (its first block equals
        the block of tokens there), in order. One hash and one dict lookup per offset and form, so a prompt
        can be searched at every offset for chunks it never marked; what to reuse there is then `lookup`'s
        answer. Slower tiers are not searched (they are asked only at the offsets `lookup` is called for)."""
        return self.blocks.chain_starts(tokens, [self.chunk_namespace(namespace, form) for form in (True, False)])

    def hold(self, hit: ChunkHit) -> None:
        """Keep a hit's blocks from being evicted (while its KV is copied out) until `release`."""
        self.blocks.hold(hit.match)

    def release(self, hit: ChunkHit) -> None:
        self.blocks.release_hold(hit.match)

    def contains(self, tokens: list[int], namespace: bytes = b"", alone: bool | None = None) -> bool:
        hit = self.lookup(tokens, namespace, alone)
        return hit is not None and hit.num_tokens == len(tokens)

    def blocks_needed(self, tokens: list[int]) -> int:
        return len(self.padded(tokens)) // self.block_size

    def store(self, tokens: list[int], fill: Callable[[list[int]], None], namespace: bytes = b"",
              alone: bool = True) -> bool:
        """File the chunk in the given form: take blocks for it, let `fill(block_ids)` write its KV at
        positions 0..n-1 into them, and hand them to the tree (an identical chunk filed meanwhile keeps its
        blocks; ours go back). False (nothing held) when the pool has no room."""
        return self.blocks.store(self.padded(tokens), fill, self.chunk_namespace(namespace, alone))
