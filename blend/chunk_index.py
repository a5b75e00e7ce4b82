"""The chunk index: position-independent cached KV for chunks of text, held in the radix cache itself.

A chunk is filed in the radix tree under its own namespace (`extra` = "chunk" + model id + tenant
salt), as if it were a prompt of its own starting at position 0, and its KV is stored rotated to
positions 0..n-1. So its key depends only on the chunk's tokens, the model and the salt, never on
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

from radix import MatchResult, RadixCache


@dataclass
class ChunkHit:
    block_ids: list[int]  # chunk-namespace blocks holding positions 0..num_tokens-1 (rounded up to blocks)
    num_tokens: int  # leading tokens of the chunk whose KV is cached
    match: MatchResult  # lock match.node while copying out of these blocks
    alone: bool = True  # the KV was computed with no other chunk before it (see the module docstring)


class ChunkIndex:
    def __init__(self, cache: RadixCache, block_size: int, model_id: str, pad_token: int, min_tokens: int = 32):
        self.cache = cache
        self.block_size = block_size
        self.model_id = model_id
        self.pad_token = pad_token
        self.min_tokens = min_tokens

    def namespace(self, salt: bytes = b"", alone: bool = True) -> bytes:
        tag = b"chunk\x00" if alone else b"chunk-in-context\x00"  # the tags differ at byte 6, whatever follows
        return tag + self.model_id.encode() + b"\x00" + salt

    def padded(self, tokens: list[int]) -> list[int]:
        return list(tokens) + [self.pad_token] * (-len(tokens) % self.block_size)

    def lookup(self, tokens: list[int], salt: bytes = b"", alone: bool | None = None) -> ChunkHit | None:
        """Cached KV for the longest cached beginning of the chunk, of either form (the alone one on a tie)
        or of the form asked for; None if nothing is cached."""
        if len(tokens) < self.min_tokens:
            return None
        padded = self.padded(tokens)
        best = None
        for form in ((True, False) if alone is None else (alone,)):
            match = self.cache.match(padded, self.namespace(salt, form), record_stats=False)
            if match.num_tokens and (best is None or match.num_tokens > best.match.num_tokens):
                best = ChunkHit(list(match.block_ids), min(match.num_tokens, len(tokens)), match, form)
        return best

    def contains(self, tokens: list[int], salt: bytes = b"", alone: bool | None = None) -> bool:
        hit = self.lookup(tokens, salt, alone)
        return hit is not None and hit.num_tokens == len(tokens)

    def blocks_needed(self, tokens: list[int]) -> int:
        return len(self.padded(tokens)) // self.block_size

    def register(self, tokens: list[int], block_ids: list[int], salt: bytes = b"", alone: bool = True) -> list[int]:
        """File caller-owned blocks holding the chunk's KV at positions 0..n-1, in the given form. Returns the
        given blocks the tree did not take (already cached): the caller frees them."""
        result = self.cache.insert(self.padded(tokens), block_ids, self.namespace(salt, alone))
        return list(result.duplicate_block_ids)
