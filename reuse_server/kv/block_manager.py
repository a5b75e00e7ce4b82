"""Sequences' KV blocks on top of the radix cache, which alone owns block state.

A sequence's block table starts with blocks it matched in the tree (kept alive by locking the matched
node), followed by blocks it owns outright. As its full blocks get computed they are published to the
tree, which takes ownership; the sequence then locks the deeper node instead. When it ends, its partial
last block becomes a tail of that chain. A prompt that leaves the cached chain inside a block (after at
least one full block) gets, at admission, a copy of the cached block (a tail or a child's first block)
sharing the most of its tokens, and starts computing after the shared ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from radix import OutOfBlocks, RadixCache

from reuse_server.engine.sequence import KVState, Sequence

# Blended KV is close to, not equal to, what a full prefill computes. It is filed under its own namespace,
# one per blending setting (recompute ratio and selection settings), so that requests which did not ask for
# blending only ever hit exact KV, and a request never reuses KV blended differently than it asked for.
APPROXIMATE = b"\x00approx"


def approximate_namespace(namespace: bytes, setting: str) -> bytes:
    return namespace + APPROXIMATE + setting.encode()


@dataclass
class Admission:
    """What the caches served an admitted sequence."""

    cached_tokens: int  # prompt tokens not to compute: the device's match and blocks loaded from tiers
    by_tier: dict[str, int] = field(default_factory=dict)  # of those, the tokens each tier below the pool gave


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, cache: RadixCache, block_size: int, enable_prefix_cache: bool = True,
                 copy_blocks: Callable[[list[int], list[int]], None] | None = None,
                 clear_blocks: Callable[[list[int]], None] | None = None, tiers=None) -> None:
        """copy_blocks: the KV pool's block copy (None: partial blocks are never reused, as in tests of the
        accounting alone); clear_blocks: the pool's reset of blocks a sequence newly takes (an fp8 pool's
        block scales must not carry a previous owner's range); tiers: the KV tiers below the pool
        (tiers.KVTiers), if any."""
        self.cache = cache
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.copy_blocks = copy_blocks
        self.clear_blocks = clear_blocks
        self.tiers = tiers

    @staticmethod
    def publish_namespace(seq: Sequence) -> bytes:
        return seq.kv.approximate_namespace if seq.kv.approximate else seq.namespace

    def _caches(self, seq: Sequence) -> bool:
        return self.enable_prefix_cache and seq.uses_prefix_cache

    def _reuses_partial_blocks(self, seq: Sequence) -> bool:
        return self._caches(seq) and self.copy_blocks is not None

    def peek_cached(self, seq: Sequence) -> int:
        """Tokens of seq a match would serve now, without counting it as a query."""
        if not self._caches(seq):
            return 0
        # Full blocks only: this orders the queue, where a partial block's few tokens change nothing.
        return self.cache.match(self._matchable(seq), seq.namespace, record_stats=False).num_tokens

    def prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """The block identities (chain hashes in seq's namespace) of the prompt's matchable full blocks,
        computed once."""
        if seq.kv.prompt_hashes is None:
            seq.kv.prompt_hashes = self.cache.hasher.hash_blocks(seq.prompt_ids[:len(seq.prompt_ids) - 1],
                                                                 seq.namespace)
        return seq.kv.prompt_hashes

    def pending_block(self, seq: Sequence, depth: int) -> bytes | None:
        """The identity of seq's prompt block that starts at token `depth` (a multiple of the block size):
        sequences with equal identities compute the same KV for that block. None past the prompt's matchable
        full blocks, or where seq does not share through the exact prefix cache."""
        index = depth // self.block_size
        if not self._caches(seq) or index >= (len(seq.prompt_ids) - 1) // self.block_size:
            return None
        return self.prompt_hashes(seq)[index]

    def next_uncached_block(self, seq: Sequence, cached_tokens: int | None = None) -> bytes | None:
        """For a waiting seq: the pending_block key of the first block the cache cannot serve now
        (`cached_tokens`: peek_cached(seq), if already looked up in this step)."""
        return self.pending_block(seq, self.peek_cached(seq) if cached_tokens is None else cached_tokens)

    def block_in_flight(self, seq: Sequence) -> bytes | None:
        """For an admitted seq still computing its prompt into the exact tree: the pending_block key of its
        first block not yet handed to the tree (being computed, or next). The caller excludes blended
        prefills, whose KV may end up approximate."""
        if not seq.is_prefilling or seq.kv.approximate or seq.kv.unpublishable:
            return None
        return self.pending_block(seq, seq.kv.num_published * self.block_size)

    def _matchable(self, seq: Sequence) -> list[int]:
        # The last token is always computed: its logits start generation.
        return seq.token_ids[: seq.num_tokens - 1]

    def admit(self, seq: Sequence, first_chunk_tokens: int, approximate_namespace: bytes | None = None,
              fill_holes: bool = True) -> Admission | None:
        """Match seq's prefix, lock it, and allocate blocks for the first chunk. Returns what the caches
        served, or None (nothing held) if the pool cannot take it now. With tiers, the blocks continuing the
        device's chain are pulled up first, and (fill_holes) blocks after a block no tier holds are loaded
        into seq's own blocks: only the hole is computed. With an approximate_namespace (the request accepts
        blending with that setting) the prefix may also come from an earlier sequence blended the same way."""
        kv = seq.kv
        assert not kv.block_table and kv.node is None
        partial = None
        by_tier: dict[str, int] = {}
        found: dict = {}
        if self._caches(seq):
            tokens = self._matchable(seq)
            if self.tiers is not None:
                by_tier = self.tiers.pull(self.cache, tokens, seq.namespace)
            match = self.cache.match(tokens, seq.namespace, record_stats=False)
            namespace = seq.namespace
            kv.approximate_namespace = approximate_namespace or b""
            if approximate_namespace is not None:
                approx = self.cache.match(tokens, approximate_namespace, record_stats=False)
                if approx.num_tokens > match.num_tokens:
                    match, namespace = approx, approximate_namespace
                    kv.approximate = True
            self.cache.lock(match.node)
            kv.node = match.node
            kv.block_table = list(match.block_ids)
            kv.num_computed = match.num_tokens
            kv.num_published = len(match.block_ids)
            if self.tiers is not None and fill_holes and not kv.approximate and approximate_namespace is None:
                found = self._after_hole(seq, len(match.block_ids))
            if match.num_tokens and self._reuses_partial_blocks(seq):
                # The prompt leaves the cached chain inside a block: copy the cached block that shares
                # the most of its tokens and compute only from the divergence on. Not at the very start:
                # a few shared template tokens would save nothing and cost the prefill its causal kernel
                # (it would start at position 3 with a mask).
                partial = self.cache.match_partial(match.node, tokens[match.num_tokens:], namespace)
            if partial is not None:
                self.cache.lock(partial.node)  # the allocation below must not evict it before the copy
                kv.num_computed += partial.num_tokens
        chunk = min(first_chunk_tokens, seq.num_tokens - kv.num_computed)
        end = max(kv.num_computed + chunk, (max(found) + 1) * self.block_size if found else 0)
        admitted = self.ensure_capacity(seq, end)
        if partial is not None:
            if admitted:  # the copy is the sequence's own block: it writes after the shared tokens
                self.copy_blocks([partial.block_id], [kv.block_table[kv.num_published]])
            self.cache.unlock(partial.node)
        if not admitted:
            self.release(seq)
            return None
        if found:
            indices = sorted(found)
            self.tiers.load([kv.block_table[i] for i in indices], [found[i] for i in indices])
            kv.filled = set(indices)
            for f in found.values():
                by_tier[f.tier] = by_tier.get(f.tier, 0) + self.block_size
        return Admission(kv.num_computed + len(found) * self.block_size, by_tier)

    def _after_hole(self, seq: Sequence, first_missing: int) -> dict:
        """Blocks of seq's prompt after its first block that no cache holds, found in the tiers: {block
        index: tiers.Found}."""
        hashes = self.prompt_hashes(seq)
        if first_missing + 1 >= len(hashes):
            return {}
        wanted = self.tiers.wanted(self.cache.hasher, seq.prompt_ids, hashes, seq.namespace, first_missing + 1)
        return self.tiers.fetch(wanted, contiguous=False)

    def computable(self, seq: Sequence) -> int:
        """Tokens seq can compute next: up to its next block already filled from a tier, or to its end."""
        kv = seq.kv
        stop = seq.num_tokens
        if kv.filled:
            stop = min(stop, min(kv.filled) * self.block_size)
        return stop - kv.num_computed

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens positions. False (and nothing taken) if it cannot."""
        kv = seq.kv
        need = blocks_for(num_tokens, self.block_size) - len(kv.block_table)
        if need <= 0:
            return True
        try:
            new = self.cache.allocate(need)
        except OutOfBlocks:
            return False
        if self.clear_blocks is not None:
            self.clear_blocks(new)
        kv.block_table.extend(new)
        kv.owned.update(new)
        return True

    def advance(self, seq: Sequence, num_tokens: int) -> None:
        """The step computed seq's next num_tokens tokens: count them (and the blocks filled from a tier that
        now follow them) and publish its full blocks."""
        kv = seq.kv
        kv.num_computed += num_tokens
        while kv.filled and kv.num_computed % self.block_size == 0 and kv.num_computed // self.block_size in kv.filled:
            kv.filled.discard(kv.num_computed // self.block_size)
            kv.num_computed += self.block_size
        self.publish(seq)

    def publish(self, seq: Sequence) -> None:
        """Hand seq's computed full blocks to the radix tree (so concurrent and later requests hit them)."""
        kv = seq.kv
        if not self._caches(seq) or kv.unpublishable:
            return
        full = kv.num_computed // self.block_size
        if full <= kv.num_published:
            return
        tokens = seq.token_ids[: full * self.block_size]
        namespace = self.publish_namespace(seq)
        result = self.cache.insert(tokens, kv.block_table[:full], namespace)
        self.cache.lock(result.node)
        if kv.node is not None:
            self.cache.unlock(kv.node)
        kv.node = result.node
        kv.owned.difference_update(result.inserted_block_ids)
        if result.duplicate_block_ids:
            # Another sequence published the same blocks first: use the tree's copies, free ours.
            tree_blocks = self.cache.match(tokens, namespace, record_stats=False).block_ids
            kv.block_table[:full] = tree_blocks
            kv.owned.difference_update(result.duplicate_block_ids)
            self.cache.free(result.duplicate_block_ids)
        kv.num_published = full

    def make_approximate(self, seq: Sequence) -> None:
        """seq's KV is about to become approximate (blended). Its leading blocks belong to the exact tree;
        give it private copies so its whole chain can be filed under the approximate namespace it was
        admitted with."""
        kv = seq.kv
        if kv.approximate or not self._caches(seq):
            return
        n = kv.num_published
        if n:
            try:
                copies = self.cache.allocate(n)
            except OutOfBlocks:
                kv.unpublishable = True  # never file approximate KV where exact KV is expected
                return
            self.copy_blocks(kv.block_table[:n], copies)
            kv.block_table[:n] = copies
            kv.owned.update(copies)
            self.cache.unlock(kv.node)
            kv.node = None
            kv.num_published = 0
        kv.approximate = True

    def file_tail(self, seq: Sequence) -> None:
        """Hand seq's partial last block (computed tokens past its published full blocks) to the tree as a
        tail of its chain, so the next turn of a conversation does not recompute those tokens."""
        kv = seq.kv
        if not self._reuses_partial_blocks(seq) or kv.unpublishable or kv.node is None:
            return
        full, rest = divmod(kv.num_computed, self.block_size)
        if not rest or not full or kv.num_published != full or len(kv.block_table) <= full:
            return
        block = kv.block_table[full]
        if block in kv.owned and self.cache.insert_tail(
                kv.node, seq.token_ids[full * self.block_size:kv.num_computed], block) is not None:
            kv.owned.discard(block)

    def release(self, seq: Sequence) -> None:
        """Give back everything seq holds (finish, abort, preemption). Published blocks stay cached, and
        so does the partial last block, as a tail."""
        self.file_tail(seq)
        kv = seq.kv
        if kv.owned:
            self.cache.free(sorted(kv.owned))
        if kv.node is not None:
            self.cache.unlock(kv.node)
        seq.kv = KVState(prompt_hashes=kv.prompt_hashes)  # the prompt's identities do not change
