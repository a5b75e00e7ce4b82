"""Sequences' KV blocks on top of the radix cache, which alone owns block state.

A sequence's block table starts with blocks it matched in the tree (kept alive by locking the matched
node), followed by blocks it owns outright. As its full blocks get computed they are published to the
tree, which takes ownership; the sequence then locks the deeper node instead. When it ends, its partial
last block becomes a tail of that chain. A prompt that leaves the cached chain inside a block (after at
least one full block) gets, at admission, a copy of the cached block (a tail or a child's first block)
sharing the most of its tokens, and starts computing after the shared ones.

This is the one code that changes the radix tree: every chain of full blocks goes in through radix's publish
(`publish`: a sequence's computed blocks) or radix's file_blocks (`store`: blocks no sequence computed, loaded
from a tier by `load_prefix`, or a blend chunk the chunk index registers), a tail through `file_tail`; the
offline replay (loadgen/simulate.py) files through the same radix publish. The chunk index reads and holds the
tree only through this class too (`lookup`, `hold`, `release_hold`, `chain_starts`: blend's BlockStore).
Admission is three steps behind one call (`admit`): `load` (the tiers' blocks continuing the cached chain go
into the tree: blocks are taken for what the tiers hold, the reads land in them, and the run read whole is
filed; blocks after a hole that a tier holds are noted), `match` (match and lock the prefix, pick a partially
shared block) and `allocate` (take the first slice's blocks, copy the shared block in, read the blocks after
the hole into the sequence's own).

What a model's sliding-window layers need is the window policy's (`kv/window_policy.py`), chosen once with the
pool: `NoWindow` (every block holds every layer: each step a no-op) or `SlidingWindow` (a hybrid model's window
layers keep their KV in parts of their own, `kv/window_parts.py`, which this class alone changes, through the
policy: every block a sequence takes gets a part, pinned; parts leave as the sequence's window slides; a match
is usable only where the window before the reuse point has its parts; the tree's eviction of a block frees its
part, `removed`). The story below is told once for both.

Prompt-cache pins (`kv/pins.py`) are the block manager's too: a computed prompt's breakpoints pin their prefixes
(`pin_breakpoints`), an admission that reads a pinned prefix renews it (`renew_pins`), and pins expire by the
clock the scheduler passes in (`expire_pins`) or give way (a tenant past its share of the pool, or a pool that
cannot admit anyone while nothing runs: `give_way`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from radix import BlockRecord, InsertResult, MatchResult, OutOfBlocks, PartialMatch, RadixCache, file_blocks, publish

from reuse_server.kv.kv_sequence import KVSequence, KVState
from reuse_server.kv.pins import Pin, PinTable
from reuse_server.kv.window_policy import NoWindow, WindowPolicy

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


@dataclass
class Loaded:
    """What the tiers gave an admission: blocks filed to extend the device's chain (tiers.Found, in chain
    order) and blocks after a hole, read into the sequence's own blocks by allocate ({block index: tiers.Found}),
    from what a tier holds there (`holes`: tiers.Held, or None)."""

    prefix: list = field(default_factory=list)
    after_hole: dict = field(default_factory=dict)
    holes: object = None

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for found in [*self.prefix, *self.after_hole.values()]:
            out[found.tier] = out.get(found.tier, 0) + block_size
        return out


class TierPartial(NamedTuple):
    """The pool's PartialMatch found in a tier instead: a held block whose first `num_tokens` tokens continue
    the matched chain as the prompt does (`found`: a tiers.Found). Loaded into the sequence's own block, which
    computes on from there, as a partially shared pool block is copied."""

    found: object
    num_tokens: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, cache: RadixCache, block_size: int, enable_prefix_cache: bool = True,
                 copy_blocks: Callable[[list[int], list[int]], None] | None = None,
                 clear_blocks: Callable[[list[int]], None] | None = None, tiers=None,
                 window: WindowPolicy | None = None, max_pinned_share: float = 0.25) -> None:
        """copy_blocks: the KV pool's block copy (None: partial blocks are never reused, as in tests of the
        accounting alone); clear_blocks: the pool's reset of blocks a sequence newly takes (an fp8 pool's
        block scales must not carry a previous owner's range); tiers: the KV tiers below the pool
        (tiers.KVTiers), if any; window: the pool's window policy (pool.window_policy(); None: NoWindow, the pool
        holds every layer of every block). Register the manager as a listener of the cache (after the tiers):
        a sliding window frees the parts of the blocks the tree evicts."""
        self.cache = cache
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.copy_blocks = copy_blocks
        self.clear_blocks = clear_blocks
        self.tiers = tiers
        self.window = window if window is not None else NoWindow()
        self.pins = PinTable()
        self.pin_budget = int(max_pinned_share * cache.num_blocks)  # blocks, per tenant
        # pins released before their time (a tenant's share, a full pool), by tenant: each tenant is shown its own
        self.given_way_by_tenant: Counter[str] = Counter()

    @staticmethod
    def publish_namespace(seq: KVSequence) -> bytes:
        return seq.kv.approximate_namespace if seq.kv.approximate else seq.namespace

    def _caches(self, seq: KVSequence) -> bool:
        return self.enable_prefix_cache and seq.uses_prefix_cache

    def _reuses_partial_blocks(self, seq: KVSequence) -> bool:
        return self._caches(seq) and self.copy_blocks is not None

    def peek_cached(self, seq: KVSequence) -> int:
        """Tokens of seq a match would serve now, without counting it as a query."""
        if not self._caches(seq):
            return 0
        # Full blocks only: this orders the queue, where a partial block's few tokens change nothing.
        return self.cache.match(self._matchable(seq), seq.namespace, record_stats=False).num_tokens

    def prompt_hashes(self, seq: KVSequence) -> list[bytes]:
        """The block identities (chain hashes in seq's namespace) of the prompt's matchable full blocks,
        computed once."""
        if seq.kv.prompt_hashes is None:
            seq.kv.prompt_hashes = self.cache.hasher.hash_blocks(seq.prompt_ids[:len(seq.prompt_ids) - 1],
                                                                 seq.namespace)
        return seq.kv.prompt_hashes

    def pending_block(self, seq: KVSequence, depth: int) -> bytes | None:
        """The identity of seq's prompt block that starts at token `depth` (a multiple of the block size):
        sequences with equal identities compute the same KV for that block. None past the prompt's matchable
        full blocks, or where seq does not share through the exact prefix cache."""
        index = depth // self.block_size
        if not self._caches(seq) or index >= (len(seq.prompt_ids) - 1) // self.block_size:
            return None
        return self.prompt_hashes(seq)[index]

    def next_uncached_block(self, seq: KVSequence, cached_tokens: int | None = None) -> bytes | None:
        """For a waiting seq: the pending_block key of the first block the cache cannot serve now
        (`cached_tokens`: peek_cached(seq), if already looked up in this step)."""
        return self.pending_block(seq, self.peek_cached(seq) if cached_tokens is None else cached_tokens)

    def block_in_flight(self, seq: KVSequence) -> bytes | None:
        """For an admitted seq still computing its prompt into the exact tree: the pending_block key of its
        first block not yet handed to the tree (being computed, or next). The caller excludes blended
        prefills, whose KV may end up approximate."""
        if not seq.is_prefilling or seq.kv.approximate or seq.kv.unpublishable:
            return None
        return self.pending_block(seq, seq.kv.num_published * self.block_size)

    def _matchable(self, seq: KVSequence) -> list[int]:
        # The last token is always computed: its logits start generation.
        return seq.token_ids[: seq.num_tokens - 1]

    # ---- admission: load, match, allocate -------------------------------------------------------
    def admit(self, seq: KVSequence, first_slice_tokens: int, approximate_namespace: bytes | None = None,
              fill_holes: bool = True) -> Admission | None:
        """Admit seq: load what the tiers hold of its prompt, match and lock its cached prefix, and allocate
        blocks for its first slice. Returns what the caches served, or None (nothing held) if the pool cannot
        take it now. fill_holes: blocks after a block no tier holds are loaded too, into seq's own blocks
        (only the hole is computed). With an approximate_namespace (the request accepts blending with that
        setting) the prefix may also come from an earlier sequence blended the same way."""
        kv = seq.kv
        assert not kv.block_table and kv.node is None
        loaded, partial = Loaded(), None
        if self._caches(seq):
            tokens = self._matchable(seq)
            loaded = self.load(seq, tokens, fill_holes and approximate_namespace is None)
            partial = self.match(seq, tokens, approximate_namespace)
        if not self.allocate(seq, first_slice_tokens, partial, loaded):
            return None
        bs = self.block_size
        by_tier = loaded.tokens_by_tier(bs)
        if isinstance(partial, TierPartial):
            by_tier[partial.found.tier] = by_tier.get(partial.found.tier, 0) + partial.num_tokens
        return Admission(kv.num_computed + len(loaded.after_hole) * bs, by_tier)

    def load(self, seq: KVSequence, tokens: list[int], fill_holes: bool) -> Loaded:
        """Admission, first: the tiers' blocks continuing the device's cached chain of seq's prompt go into
        the pool and the tree (load_prefix); with fill_holes, the blocks after the first block no cache holds
        that a tier holds are noted (read into seq's own blocks once allocate has taken them)."""
        if self.tiers is None:
            return Loaded()
        chain, pulled = self._load_prefix(tokens, seq.namespace)
        return Loaded(pulled, holes=self._after_hole(seq, chain) if fill_holes else None)

    def match(self, seq: KVSequence, tokens: list[int], approximate_namespace: bytes | None
              ) -> PartialMatch | TierPartial | None:
        """Admission, second: match seq's prefix (exact, or blended the same way if that is longer), lock it
        and start seq's block table with it. Returns the cached block sharing the most of the prompt's next
        block's tokens, locked (allocate copies it and unlocks it), or a tier's block sharing more, or None."""
        kv = seq.kv
        match = self._usable_match(tokens, seq.namespace)
        namespace = seq.namespace
        kv.approximate_namespace = approximate_namespace or b""
        if approximate_namespace is not None:
            approx = self._usable_match(tokens, approximate_namespace)
            if approx.num_tokens > match.num_tokens:
                match, namespace = approx, approximate_namespace
                kv.approximate = True
        self.cache.lock(match.node)
        kv.node = match.node
        kv.block_table = list(match.block_ids)
        kv.num_computed = match.num_tokens
        kv.num_published = len(match.block_ids)
        self.window.start(kv, match.num_tokens)
        if not match.num_tokens or not self._reuses_partial_blocks(seq):
            # Not at the very start: a few shared template tokens would save nothing and cost the prefill its
            # causal kernel (it would start at position 3 with a mask).
            return None
        # The prompt leaves the cached chain inside a block: copy the cached block that shares the most of
        # its tokens and compute only from the divergence on.
        partial = self.cache.match_partial(match.node, tokens[match.num_tokens:], namespace)
        if partial is not None and not self.window.has_kv(partial.block_id):
            partial = None  # its window layers' KV is gone: the copy would lack it
        if self.tiers is not None and not kv.approximate:  # a pool hit's partial block, missed from a tier
            held = self._tier_partial(seq, tokens, match.num_tokens)
            if held is not None and (partial is None or held.num_tokens > partial.num_tokens):
                partial = held
        if isinstance(partial, PartialMatch):
            self.cache.lock(partial.node)  # allocating must not evict it before the copy
            self.window.pin([partial.block_id])  # nor its window part
        if partial is not None:
            kv.num_computed += partial.num_tokens
        return partial

    def _tier_partial(self, seq: KVSequence, tokens: list[int], matched: int) -> TierPartial | None:
        """The tiers' block continuing the chain matched up to `matched` tokens that shares the most of the
        prompt's next tokens (tiers keep whole blocks by hash, so a prompt that leaves a cached prompt inside a
        block finds that block only this way)."""
        bs = self.block_size
        following = tokens[matched:matched + bs]
        if not following or matched < bs:
            return None
        held = self.tiers.partial(self.prompt_hashes(seq)[matched // bs - 1], following)
        return TierPartial(*held) if held is not None else None

    def _usable_match(self, tokens: list[int], namespace: bytes) -> MatchResult:
        """The cached prefix of tokens that the model can continue from: all of it, except on a hybrid pool,
        where it ends at the last block boundary whose window (the blocks a query there still sees) has its
        window parts."""
        match = self.cache.match(tokens, namespace, record_stats=False)
        usable = self.window.usable(match.block_ids)
        if usable == len(match.block_ids):
            return match
        return self.cache.match(tokens[:usable * self.block_size], namespace, record_stats=False)

    def allocate(self, seq: KVSequence, first_slice_tokens: int, partial: PartialMatch | TierPartial | None,
                 loaded: Loaded) -> bool:
        """Admission, last: take blocks for seq's first slice (and up to its last block a tier holds after a
        hole), copy the partially shared block in and read the blocks after the hole into seq's own blocks
        (loaded.holes; loaded.after_hole gets those read: a block whose read failed is computed). False (and
        everything released) when the pool cannot give them."""
        kv = seq.kv
        first_slice = min(first_slice_tokens, seq.num_tokens - kv.num_computed)
        holes = loaded.holes.blocks if loaded.holes is not None else []
        end = max(kv.num_computed + first_slice, (holes[-1].index + 1) * self.block_size if holes else 0)
        admitted = self.ensure_capacity(seq, end)
        if isinstance(partial, TierPartial):
            if admitted:  # into the sequence's own block, as below
                self.tiers.load([kv.block_table[kv.num_published]], [partial.found])
        elif partial is not None:
            if admitted:  # the copy is the sequence's own block: it writes after the shared tokens
                self.copy_blocks([partial.block_id], [kv.block_table[kv.num_published]])
            self.cache.unlock(partial.node)
            self.window.unpin([partial.block_id])
        if not admitted:
            self.release(seq)
            return False
        if holes:
            loaded.after_hole = self.tiers.fetch(holes, contiguous=False, tiers=loaded.holes.tiers,
                                                 into={w.index: kv.block_table[w.index] for w in holes})
            kv.filled = set(loaded.after_hole)
        return True

    def _after_hole(self, seq: KVSequence, first_missing: int):
        """The blocks of seq's prompt after its first block that no cache holds, that a tier holds (tiers.Held,
        in prompt order; allocate reads them), or None."""
        hashes = self.prompt_hashes(seq)
        if first_missing + 1 >= len(hashes):
            return None
        wanted = self.tiers.wanted(self.cache.hasher, seq.prompt_ids, hashes, seq.namespace, first_missing + 1)
        return self.tiers.held(wanted, contiguous=False)

    # ---- the chunk index's reads of the tree (blend.chunk_index.BlockStore) ---------------------------
    def lookup(self, tokens: list[int], namespace: bytes) -> MatchResult:
        """The cached chain of `tokens` (full blocks) in `namespace`, after loading what the tiers hold
        continuing it (so chunks computed before a restart or by another server are found). Not a query of
        the prefix cache's statistics. Hold it (`hold`) before anything takes blocks."""
        self.load_prefix(tokens, namespace)
        return self.cache.match(tokens, namespace, record_stats=False)

    def hold(self, match: MatchResult) -> None:
        """Keep a looked-up chain from being evicted until `release_hold`."""
        self.cache.lock(match.node)

    def release_hold(self, match: MatchResult) -> None:
        self.cache.unlock(match.node)

    def chain_starts(self, tokens: list[int], namespaces: list[bytes]) -> list[int]:
        """Offsets of `tokens` where a chain filed under one of `namespaces` begins (RadixCache.chain_starts)."""
        return self.cache.chain_starts(tokens, namespaces)

    # ---- blocks filled from outside a sequence: the tiers, the chunk index ----------------------------
    def load_prefix(self, tokens: list[int], namespace: bytes) -> dict[str, int]:
        """Load the blocks that continue the device's cached chain of `tokens` (full blocks only) from the
        tiers into the pool and file them in the radix tree (prefetch, the chunk index, admission). Returns
        the tokens loaded from each tier."""
        if self.tiers is None:
            return {}
        return Loaded(self._load_prefix(tokens, namespace)[1]).tokens_by_tier(self.block_size)

    def _load_prefix(self, tokens: list[int], namespace: bytes) -> "tuple[int, list]":
        """(blocks of the device's chain now, the tiers.Found filed to extend it)."""
        bs = self.block_size
        match = self.cache.match(tokens, namespace, record_stats=False)
        have = len(match.block_ids)
        if have >= len(tokens) // bs:
            return have, []
        hashes = self.cache.hasher.hash_blocks(tokens, namespace)
        held = self.tiers.held(self.tiers.wanted(self.cache.hasher, tokens, hashes, namespace, have), contiguous=True)
        if not held.blocks:
            return have, []
        ordered: list = []

        def fill(blocks: list[int]) -> int:  # read straight into the blocks taken; the run found is filed
            found = self.tiers.fetch(held.blocks, contiguous=True, tiers=held.tiers,
                                     into={w.index: b for w, b in zip(held.blocks, blocks)})
            ordered.extend(found[i] for i in range(have, have + len(found)))
            return len(ordered)

        self.cache.lock(match.node)  # taking blocks must not evict the chain the loaded ones continue
        try:
            stored = self.store(tokens[:(have + len(held.blocks)) * bs], fill, namespace, match.block_ids)
        finally:
            self.cache.unlock(match.node)
        return (have + len(ordered), ordered) if stored else (have, [])

    def store(self, tokens: list[int], fill: Callable[[list[int]], int | None], namespace: bytes,
              cached: list[int] = ()) -> bool:
        """File whole blocks of KV that no sequence computed (loaded from a tier, or a blend chunk) in the
        tree: the first len(cached) blocks of `tokens` are the tree's already; blocks are taken for the
        rest, `fill(block_ids)` writes their KV, and the tree takes them. fill returns None (it filled them
        all) or how many of the first it filled (a tier's read came up short): the others go back, and only
        the filled run is filed. False (nothing held) when the pool has no room or nothing was filled."""
        try:
            blocks = self.cache.allocate(len(tokens) // self.block_size - len(cached))
        except OutOfBlocks:
            return False
        if not self.window.attach(blocks):
            self.cache.free(blocks)
            return False
        try:
            filled = fill(blocks)
        except BaseException:
            self._free_owned(blocks, pinned=True)
            raise
        if filled is not None and filled < len(blocks):
            self._free_owned(blocks[filled:], pinned=True)
            blocks, tokens = blocks[:filled], tokens[:(len(cached) + filled) * self.block_size]
            if not blocks:
                return False
        self.window.unpin(blocks)  # cached with the tree's blocks: no sequence needs them yet
        self._file(tokens, list(cached) + blocks, namespace)
        return True

    def _file(self, tokens: list[int], block_ids: list[int], namespace: bytes) -> InsertResult:
        """The one way blocks go into the radix tree for `store` (radix's file_blocks; `publish` files through
        radix's publish, with the same hand-over): those the tree held already are freed."""
        return file_blocks(self.cache, tokens, block_ids, namespace, self._hand_over(tokens, block_ids, namespace))

    def _hand_over(self, tokens: list[int], block_ids: list[int], namespace: bytes) -> Callable[[InsertResult], None]:
        """What filing does with the duplicates of blocks the tree held already, before they are freed: the
        tree's copies take their window parts' pins (and parts they lack)."""
        def hand_over(result: InsertResult) -> None:
            self.window.hand_over(block_ids, result.duplicate_block_ids,
                                  lambda: self.cache.match(tokens, namespace, record_stats=False).block_ids)
        return hand_over

    def _free_owned(self, blocks: list[int], pinned: bool) -> None:
        """Give caller-owned blocks back to the cache, their window parts (pinned once, or not) too."""
        self.window.free(blocks, pinned)
        self.cache.free(blocks)

    def removed(self, records: list[BlockRecord]) -> None:
        """The cache evicted these blocks (as its listener, after the tiers copied them out): their window
        parts are free."""
        self.window.drop([r.block_id for r in records])

    def stored(self, records: list[BlockRecord]) -> None:
        pass

    def computable(self, seq: KVSequence) -> int:
        """Tokens seq can compute next: up to its next block already filled from a tier, or to its end."""
        kv = seq.kv
        stop = seq.num_tokens
        if kv.filled:
            stop = min(stop, min(kv.filled) * self.block_size)
        return stop - kv.num_computed

    def ensure_capacity(self, seq: KVSequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens positions. False (and nothing taken) if it cannot."""
        kv = seq.kv
        need = blocks_for(num_tokens, self.block_size) - len(kv.block_table)
        if need <= 0:
            return True
        try:
            new = self.cache.allocate(need)
        except OutOfBlocks:
            return False
        if not self.window.attach(new):
            self.cache.free(new)
            return False
        if self.clear_blocks is not None:
            self.clear_blocks(new)
        kv.block_table.extend(new)
        kv.owned.update(new)
        return True

    def advance(self, seq: KVSequence, num_tokens: int) -> None:
        """The step computed seq's next num_tokens tokens: count them (and the blocks filled from a tier that
        now follow them) and publish its full blocks."""
        kv = seq.kv
        kv.num_computed += num_tokens
        while kv.filled and kv.num_computed % self.block_size == 0 and kv.num_computed // self.block_size in kv.filled:
            kv.filled.discard(kv.num_computed // self.block_size)
            kv.num_computed += self.block_size
        self.publish(seq)
        self.window.slide(kv, kv.num_computed)

    def publish(self, seq: KVSequence) -> None:
        """Hand seq's computed full blocks to the radix tree (so concurrent and later requests hit them)."""
        kv = seq.kv
        if not self._caches(seq) or kv.unpublishable:
            return
        full = kv.num_computed // self.block_size
        if full <= kv.num_published:
            return
        tokens = seq.token_ids[: full * self.block_size]
        namespace = self.publish_namespace(seq)
        filed = kv.block_table[:full]
        result = publish(self.cache, tokens, filed, namespace, kv.node, self._hand_over(tokens, filed, namespace))
        kv.node = result.node
        kv.owned.difference_update(result.inserted_block_ids)
        if result.duplicate_block_ids:
            # Another sequence published the same blocks first (ours are freed): use the tree's copies.
            kv.block_table[:full] = self.cache.match(tokens, namespace, record_stats=False).block_ids
            kv.owned.difference_update(result.duplicate_block_ids)
        kv.num_published = full

    def make_approximate(self, seq: KVSequence) -> None:
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
            originals = self.window.attach_copies(kv, copies)
            if originals is None:
                self.cache.free(copies)
                kv.unpublishable = True
                return
            self.copy_blocks(kv.block_table[:n], copies)
            self.window.unpin(originals)
            kv.block_table[:n] = copies
            kv.owned.update(copies)
            self.cache.unlock(kv.node)
            kv.node = None
            kv.num_published = 0
        kv.approximate = True

    def file_tail(self, seq: KVSequence) -> None:
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

    # ---- prompt-cache pins ------------------------------------------------------------------------
    def pin_breakpoints(self, seq: KVSequence, now: float) -> None:
        """seq's prompt is computed: pin the whole blocks up to each of its breakpoints (a pin there already is
        renewed), then hold its tenant to its share of the pool, its least recently used pins giving way."""
        kv = seq.kv
        if not seq.options.breakpoints or not self._caches(seq) or kv.approximate or kv.unpublishable:
            return
        tenant = seq.options.tenant or ""
        for bp in seq.options.breakpoints:
            end = min(bp.offset, len(seq.prompt_ids))
            blocks = end // self.block_size
            if not blocks:
                continue
            match = self.cache.match(seq.prompt_ids[:blocks * self.block_size], seq.namespace, record_stats=False)
            if not match.block_ids:
                continue
            held = self._breakpoint_blocks(seq, end, match)
            pin = self.pins.get(match.node)
            if pin is not None and (pin.held is held.node or held.node is match.node):
                pin.renew(now, bp.ttl)
                continue
            ttl = bp.ttl
            if pin is not None:  # it stops before the block this breakpoint falls in: pinned again with it
                ttl = max(ttl, pin.ttl)
                self._unpin(pin)
            window = self.window.pin_before(held.block_ids, match.num_tokens)
            self.cache.pin(held.node)
            self.pins.add(match.node, held.node, tenant, held.num_tokens, ttl, now, window)
        while self.pins.blocks_of(tenant) > self.pin_budget:
            self._give_way(self.pins.oldest(tenant))

    def _breakpoint_blocks(self, seq: KVSequence, end: int, whole: MatchResult) -> MatchResult:
        """The cached blocks a breakpoint at `end` pins: `whole` (those before it), and the block it falls in
        when the tree holds it (the prompt goes on past that block), so that a hit reads to the breakpoint."""
        if end % self.block_size == 0:
            return whole
        upto = (end // self.block_size + 1) * self.block_size
        deeper = self.cache.match(seq.prompt_ids[:upto], seq.namespace, record_stats=False)
        return deeper if deeper.num_tokens == upto else whole

    def renew_pins(self, seq: KVSequence, now: float) -> None:
        """seq was admitted reading its matched prefix: the pins inside it live on from now."""
        for pin in self.pins.on_path(seq.kv.node):
            pin.renew(now)

    def expire_pins(self, now: float) -> int:
        """Release the pins whose time is up (their blocks become ordinary cache); how many."""
        expired = self.pins.expired(now)
        for pin in expired:
            self._unpin(pin)
        return len(expired)

    def give_way(self) -> bool:
        """Release the least recently used pin of any tenant (the pool must admit a request); False if none."""
        pin = self.pins.oldest()
        if pin is None:
            return False
        self._give_way(pin)
        return True

    @property
    def pins_given_way(self) -> int:
        return sum(self.given_way_by_tenant.values())

    def _give_way(self, pin: Pin) -> None:
        self._unpin(pin)
        self.given_way_by_tenant[pin.tenant] += 1

    def _unpin(self, pin: Pin) -> None:
        self.pins.remove(pin)
        self.window.unpin(pin.window_blocks)
        self.cache.unpin(pin.held)

    def stored_prompt_tokens(self, seq: KVSequence, cached_tokens: int) -> int:
        """OpenAI's cache writes: the prompt tokens seq computed into whole blocks that the cache now keeps."""
        if not self._caches(seq) or seq.kv.unpublishable:
            return 0
        return max(0, len(seq.prompt_ids) // self.block_size * self.block_size - cached_tokens)

    def release(self, seq: KVSequence) -> None:
        """Give back everything seq holds (finish, abort, preemption). Published blocks stay cached, and
        so does the partial last block, as a tail."""
        self.file_tail(seq)
        kv = seq.kv
        self.window.release(kv)
        if kv.owned:
            self._free_owned(sorted(kv.owned), pinned=False)
        if kv.node is not None:
            self.cache.unlock(kv.node)
        seq.kv = KVState(prompt_hashes=kv.prompt_hashes)  # the prompt's identities do not change
