"""Sequences' KV blocks on top of the radix cache, which alone owns block state.

A sequence's block table starts with blocks it matched in the tree (kept alive by locking the matched
node), followed by blocks it owns outright. As its full blocks get computed they are published to the
tree, which takes ownership; the sequence then locks the deeper node instead. When it ends, its partial
last block becomes a tail of that chain. A prompt that leaves the cached chain inside a block (after at
least one full block) gets, at admission, a copy of the cached block (a tail or a child's first block)
sharing the most of its tokens, and starts computing after the shared ones.
"""
from __future__ import annotations

from typing import Callable

from radix import OutOfBlocks, RadixCache

from reuse_server.sequence import Sequence

# Blended KV is close to, not equal to, what a full prefill computes. It is filed under its own namespace,
# one per blending setting (recompute ratio and selection settings), so that requests which did not ask for
# blending only ever hit exact KV, and a request never reuses KV blended differently than it asked for.
APPROXIMATE = b"\x00approx"


def approximate_namespace(setting: str) -> bytes:
    return APPROXIMATE + setting.encode()


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, cache: RadixCache, block_size: int, enable_prefix_cache: bool = True,
                 copy_blocks: Callable[[list[int], list[int]], None] | None = None) -> None:
        self.cache = cache
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.copy_blocks = copy_blocks

    @staticmethod
    def publish_key(seq: Sequence) -> bytes:
        return seq.extra_key + seq.approximate_key if seq.approximate else seq.extra_key

    def _caches(self, seq: Sequence) -> bool:
        return self.enable_prefix_cache and seq.uses_prefix_cache

    def _reuses_partial_blocks(self, seq: Sequence) -> bool:
        return self._caches(seq) and self.copy_blocks is not None

    def peek_cached(self, seq: Sequence) -> int:
        """Tokens of seq a match would serve now, without counting it as a query."""
        if not self._caches(seq):
            return 0
        # Full blocks only: this orders the queue, where a partial block's few tokens change nothing.
        return self.cache.match(self._matchable(seq), seq.extra_key, record_stats=False).num_tokens

    def pending_block(self, seq: Sequence, depth: int) -> tuple | None:
        """A key for seq's prompt block that starts at token `depth`, together with every token before it:
        sequences with equal keys compute the same KV for that block. None past the prompt's matchable full
        blocks, or where seq does not share through the exact prefix cache."""
        end = depth + self.block_size
        if not self._caches(seq) or end > len(seq.prompt_ids) - 1:
            return None
        return seq.extra_key, depth, hash(tuple(seq.prompt_ids[:end]))

    def next_uncached_block(self, seq: Sequence, cached_tokens: int | None = None) -> tuple | None:
        """For a waiting seq: the pending_block key of the first block the cache cannot serve now
        (`cached_tokens`: peek_cached(seq), if already looked up in this step)."""
        return self.pending_block(seq, self.peek_cached(seq) if cached_tokens is None else cached_tokens)

    def block_in_flight(self, seq: Sequence) -> tuple | None:
        """For an admitted seq still computing its prompt into the exact tree: the pending_block key of its
        first block not yet handed to the tree (being computed, or next)."""
        if not seq.is_prefilling or seq.approximate or seq.unpublishable or seq.blend_plan is not None:
            return None
        return self.pending_block(seq, seq.num_inserted_blocks * self.block_size)

    def _matchable(self, seq: Sequence) -> list[int]:
        # The last token is always computed: its logits start generation.
        return seq.token_ids[: seq.num_tokens - 1]

    def admit(self, seq: Sequence, first_chunk_tokens: int, approximate_key: bytes | None = None) -> bool:
        """Match seq's prefix, lock it, and allocate blocks for the first chunk. False (nothing held) if
        the pool cannot take it now. With an approximate_key (the request accepts blending with that
        setting) the prefix may also come from an earlier sequence blended the same way."""
        assert not seq.block_table and seq.node is None
        partial = None
        if self._caches(seq):
            tokens = self._matchable(seq)
            match = self.cache.match(tokens, seq.extra_key, record_stats=False)
            key = seq.extra_key
            seq.approximate_key = approximate_key or b""
            if approximate_key is not None:
                approx = self.cache.match(tokens, seq.extra_key + approximate_key, record_stats=False)
                if approx.num_tokens > match.num_tokens:
                    match, key = approx, seq.extra_key + approximate_key
                    seq.approximate = True
            self.cache.lock(match.node)
            seq.node = match.node
            seq.block_table = list(match.block_ids)
            seq.num_computed = match.num_tokens
            seq.num_inserted_blocks = len(match.block_ids)
            if match.num_tokens and self._reuses_partial_blocks(seq):
                # The prompt leaves the cached chain inside a block: copy the cached block that shares
                # the most of its tokens and compute only from the divergence on. Not at the very start:
                # a few shared template tokens would save nothing and cost the prefill its causal kernel
                # (it would start at position 3 with a mask: +150 MiB under load, slower cold prompts).
                partial = self.cache.match_partial(match.node, tokens[match.num_tokens:], key)
            if partial is not None:
                self.cache.lock(partial.node)  # the allocation below must not evict it before the copy
                seq.num_computed += partial.num_tokens
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.num_computed
        chunk = min(first_chunk_tokens, seq.num_tokens - seq.num_computed)
        admitted = self.ensure_capacity(seq, seq.num_computed + chunk)
        if partial is not None:
            if admitted:  # the copy is the sequence's own block: it writes after the shared tokens
                self.copy_blocks([partial.block_id], [seq.block_table[seq.num_inserted_blocks]])
            self.cache.unlock(partial.node)
        if not admitted:
            self.release(seq)
            return False
        return True

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens positions. False (and nothing taken) if it cannot."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        try:
            new = self.cache.allocate(need)
        except OutOfBlocks:
            return False
        seq.block_table.extend(new)
        seq.owned.update(new)
        return True

    def publish(self, seq: Sequence) -> None:
        """Hand seq's computed full blocks to the radix tree (so concurrent and later requests hit them)."""
        if not self._caches(seq):
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_inserted_blocks:
            return
        tokens = seq.token_ids[: full * self.block_size]
        if seq.unpublishable:
            return
        result = self.cache.insert(tokens, seq.block_table[:full], self.publish_key(seq))
        self.cache.lock(result.node)
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.node = result.node
        seq.owned.difference_update(result.inserted_block_ids)
        if result.duplicate_block_ids:
            # Another sequence published the same blocks first: use the tree's copies, free ours.
            tree_blocks = self.cache.match(tokens, self.publish_key(seq), record_stats=False).block_ids
            seq.block_table[:full] = tree_blocks
            seq.owned.difference_update(result.duplicate_block_ids)
            self.cache.free(result.duplicate_block_ids)
        seq.num_inserted_blocks = full

    def make_approximate(self, seq: Sequence) -> None:
        """seq's KV is about to become approximate (blended). Its leading blocks belong to the exact tree;
        give it private copies so its whole chain can be filed under the approximate namespace it was
        admitted with."""
        if seq.approximate or not self._caches(seq):
            return
        n = seq.num_inserted_blocks
        if n:
            try:
                copies = self.cache.allocate(n)
            except OutOfBlocks:
                seq.unpublishable = True  # never file approximate KV where exact KV is expected
                return
            self.copy_blocks(seq.block_table[:n], copies)
            seq.block_table[:n] = copies
            seq.owned.update(copies)
            self.cache.unlock(seq.node)
            seq.node = None
            seq.num_inserted_blocks = 0
        seq.approximate = True

    def file_tail(self, seq: Sequence) -> None:
        """Hand seq's partial last block (computed tokens past its published full blocks) to the tree as a
        tail of its chain, so the next turn of a conversation does not recompute those tokens."""
        if not self._reuses_partial_blocks(seq) or seq.unpublishable or seq.node is None:
            return
        full, rest = divmod(seq.num_computed, self.block_size)
        if not rest or not full or seq.num_inserted_blocks != full or len(seq.block_table) <= full:
            return
        block = seq.block_table[full]
        if block in seq.owned and self.cache.insert_tail(
                seq.node, seq.token_ids[full * self.block_size:seq.num_computed], block) is not None:
            seq.owned.discard(block)

    def release(self, seq: Sequence) -> None:
        """Give back everything seq holds (finish, abort, preemption). Published blocks stay cached, and
        so does the partial last block, as a tail."""
        self.file_tail(seq)
        if seq.owned:
            self.cache.free(sorted(seq.owned))
            seq.owned.clear()
        if seq.node is not None:
            self.cache.unlock(seq.node)
            seq.node = None
        seq.block_table = []
        seq.num_computed = 0
        seq.num_inserted_blocks = 0
        seq.approximate = False
        seq.approximate_key = b""
        seq.unpublishable = False
