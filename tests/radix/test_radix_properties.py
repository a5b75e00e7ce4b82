"""Property tests: random interleavings of match / insert / tails / lock / unlock / pin / unpin / allocate /
free / evict.

After every step the cache's own invariant check must pass (free + evictable + in use == total, no
block in two states, counters and eviction queue agree with the tree), locked blocks must never have
been evicted, pinned blocks are exactly the blocks on pinned paths and never evicted, every stored and removed full block must be reported to the listener with its hash, parent hash,
tokens and namespace, and every match must return exactly the longest cached prefix, each block holding
KV for the very tokens (and namespace) of the prompt. A reference model tracks what each tree block holds.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radix import OutOfBlocks, RadixCache

BS = 2
NUM_BLOCKS = 12
# Blocks drawn from a tiny alphabet so that prompts share prefixes and diverge inside node runs.
BLOCKS = [(0, 0), (0, 1), (1, 0), (1, 1)]
prompts = st.tuples(
    st.lists(st.sampled_from(BLOCKS), max_size=6),
    st.lists(st.integers(0, 1), max_size=BS - 1),  # a partial last block, never cached
).map(lambda parts: [t for block in parts[0] for t in block] + parts[1])
namespaces = st.sampled_from([b"", b"tenant-b"])


class RadixCacheMachine(RuleBasedStateMachine):
    policy = "lru"
    hash_bits = None

    @initialize()
    def setup(self):
        self.cache = RadixCache(NUM_BLOCKS, block_size=BS, policy=self.policy, hash_bits=self.hash_bits,
                                identity=b"model", listener=self)
        self.reported = {}  # block id -> BlockRecord, from the listener's stored / removed events
        self.holds = {}  # tree block id of a full block -> (namespace, tokens of the whole prefix through that block)
        self.tails = {}  # tree block id of a tail -> (namespace, tokens of the prefix through the tail)
        self.locks = []  # (node, block ids on its path) per outstanding lock
        self.pins = []  # (node, block ids on its path) per outstanding pin
        self.owned = []  # caller-owned block ids
        self.filed = []  # (prompt, namespace) of requests that filed a tail
        self.partial_hits = 0

    # the cache's listener
    def stored(self, records):
        for r in records:
            assert r.block_id not in self.reported, "a block stored twice"
            self.reported[r.block_id] = r

    def removed(self, records):
        locked = {b for _, ids in self.locks + self.pins for b in ids}
        for r in records:
            assert r.block_id not in locked, "a locked or pinned block was evicted"
            assert self.reported.pop(r.block_id) == r, "removed a block as other than it was stored"
            (self.holds if r.named else self.tails).pop(r.block_id)

    def check_record(self, block):
        """The stored event of a tree block names what it holds: the hash chain of its prefix, its tokens."""
        namespace, prefix = self.holds[block]
        record = self.reported[block]
        hashes = self.cache.hasher.hash_blocks(list(prefix), namespace)
        parent = hashes[-2] if len(hashes) > 1 else self.cache.hasher.root(namespace)
        assert record == (hashes[-1], parent, bytes(np.array(prefix[-BS:], "<i4").tobytes()), namespace, block)

    def expected_match(self, prompt, namespace):
        n = 0
        while n < len(prompt) // BS and (namespace, tuple(prompt[: (n + 1) * BS])) in self.holds.values():
            n += 1
        return n

    def check_match(self, m, prompt, namespace):
        assert m.num_tokens == len(m.block_ids) * BS == self.expected_match(prompt, namespace) * BS
        for i, block in enumerate(m.block_ids):
            assert self.holds[block] == (namespace, tuple(prompt[: (i + 1) * BS])), "match returned wrong KV"

    @rule(prompt=prompts, namespace=namespaces, lock=st.booleans())
    def match(self, prompt, namespace, lock):
        m = self.cache.match(prompt, namespace)
        self.check_match(m, prompt, namespace)
        if lock:
            self.cache.lock(m.node)
            self.locks.append((m.node, list(m.block_ids)))

    def serve(self, prompt, namespace, spare=0):
        """The engine's path: match, lock, allocate the missing full blocks (and `spare` more), insert the
        full ones, lock the new chain instead of the match. None (nothing held) when the pool is full."""
        m = self.cache.match(prompt, namespace, record_stats=False)
        self.check_match(m, prompt, namespace)
        self.cache.lock(m.node)
        need = len(prompt) // BS - len(m.block_ids) + spare
        try:
            new = self.cache.allocate(need)
        except OutOfBlocks:
            assert need > self.cache.num_allocatable()
            self.cache.unlock(m.node)
            return None
        inserted = new[: len(new) - spare]
        r = self.cache.insert(prompt, m.block_ids + inserted, namespace)
        assert r.duplicate_block_ids == [] and r.inserted_block_ids == inserted
        for i, block in enumerate(inserted, len(m.block_ids)):
            self.holds[block] = (namespace, tuple(prompt[: (i + 1) * BS]))
            self.check_record(block)
        self.cache.lock(r.node)
        self.cache.unlock(m.node)
        return m.block_ids + new, r.node

    @rule(prompt=prompts, namespace=namespaces, keep_locked=st.booleans())
    def run_request(self, prompt, namespace, keep_locked):
        served = self.serve(prompt, namespace)
        if served is None:
            return
        blocks, node = served
        if keep_locked:
            self.locks.append((node, blocks))
        else:
            self.cache.unlock(node)

    @rule(prompt=prompts, namespace=namespaces)
    def insert_own_blocks(self, prompt, namespace):
        """A request that computed its whole prompt into its own blocks (e.g. raced another one)."""
        n = len(prompt) // BS
        if n > len(self.owned):
            return
        given, self.owned = self.owned[:n], self.owned[n:]
        cached = self.expected_match(prompt, namespace)
        r = self.cache.insert(prompt, given, namespace)
        assert r.duplicate_block_ids == given[:cached] and r.inserted_block_ids == given[cached:]
        for i, block in enumerate(r.inserted_block_ids, cached):
            self.holds[block] = (namespace, tuple(prompt[: (i + 1) * BS]))
            self.check_record(block)
        self.owned += r.duplicate_block_ids

    @rule(prompt=prompts, namespace=namespaces, lock_tail=st.booleans(), chain_locked=st.booleans())
    def finish_request(self, prompt, namespace, lock_tail, chain_locked):
        """The engine's path when a request ends: its full blocks go into the tree, its partial last block
        becomes a tail of that chain."""
        full = len(prompt) // BS
        partial = len(prompt) > full * BS
        served = self.serve(prompt, namespace, spare=int(partial))
        if served is None:
            return
        blocks, chain = served
        if not chain_locked:  # the chain may be an evictable leaf when the tail arrives
            self.cache.unlock(chain)
        if partial and full:
            key, block = (namespace, tuple(prompt)), blocks[full]
            # Already served: the same tail (BS 2: a tail is one token), or a full block that starts with it.
            known = any(e == namespace and t[: len(prompt)] == key[1] and len(t) in (len(prompt), (full + 1) * BS)
                        for e, t in self.all_blocks().values())
            tail = self.cache.insert_tail(chain, prompt[full * BS:], block)
            assert (tail is None) == known
            if tail is None:
                self.cache.free([block])
            else:
                self.tails[block] = key
                assert self.reported[block] == (b"", self.reported[blocks[full - 1]].hash,
                                                np.array(prompt[full * BS:], "<i4").tobytes(), namespace, block)
                self.filed.append((prompt, namespace))
                if lock_tail:
                    self.cache.lock(tail)
                    self.locks.append((tail, blocks))
        elif partial:
            self.cache.free([blocks[full]])
        if chain_locked:
            self.cache.unlock(chain)

    @precondition(lambda self: self.filed)
    @rule(data=st.data(), change_last=st.booleans())
    def match_partial(self, data, change_last):
        """Where a prompt leaves the cached chain, the block after it (a tail or a child's first block) that
        shares its next token is found; with BS 2 a partial match is exactly one token."""
        prompt, namespace = data.draw(st.sampled_from(self.filed))
        if change_last:
            prompt = prompt[:-1] + [1 - prompt[-1]]
        prompt = prompt + data.draw(st.lists(st.integers(0, 1), max_size=BS))
        m = self.cache.match(prompt, namespace, record_stats=False)
        self.check_match(m, prompt, namespace)
        n = m.num_tokens
        p = self.cache.match_partial(m.node, prompt[n:], namespace)
        want = tuple(prompt[: n + 1])
        servable = [b for b, (e, t) in self.all_blocks().items()
                    if e == namespace and len(t) in (n + 1, n + BS) and t[: n + 1] == want]
        if len(prompt) > n and servable:
            assert p is not None and p.num_tokens == 1 and p.block_id in servable
            self.partial_hits += 1
        else:
            assert p is None

    @rule(n=st.integers(0, NUM_BLOCKS + 2))
    def allocate(self, n):
        before = self.cache.stats()
        try:
            self.owned += self.cache.allocate(n)
        except OutOfBlocks:
            assert n > before.free_blocks + before.evictable_blocks
            assert self.cache.stats() == before

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        chosen = data.draw(st.lists(st.sampled_from(self.owned), unique=True, min_size=1))
        self.cache.free(chosen)
        self.owned = [b for b in self.owned if b not in chosen]

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(prompt=prompts, namespace=namespaces)
    def pin(self, prompt, namespace):
        """A prompt-cache breakpoint: the cached prefix of a prompt is pinned (the block manager pins what
        it matched, whole blocks)."""
        m = self.cache.match(prompt, namespace, record_stats=False)
        self.check_match(m, prompt, namespace)
        if m.block_ids:
            self.cache.pin(m.node)
            self.pins.append((m.node, list(m.block_ids)))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        node, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.cache.unpin(node)

    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict(self, n):
        evictable = self.cache.stats().evictable_blocks
        assert len(self.cache.evict(n)) == min(n, evictable)

    def all_blocks(self):
        """Every tree block's (namespace, prefix tokens): full blocks and tails."""
        return {**self.holds, **self.tails}

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        s = self.cache.stats()
        assert s.free_blocks + s.evictable_blocks + s.in_use_blocks == s.total_blocks
        assert s.cached_blocks == len(self.all_blocks())
        assert s.cached_tokens == len(self.holds) * BS + sum(len(t) % BS for _, t in self.tails.values())
        assert set(self.reported) == set(self.all_blocks()), "the events disagree with the tree's blocks"
        assert s.in_use_blocks >= len(self.owned) + len({b for _, ids in self.locks + self.pins for b in ids})
        assert s.pinned_blocks == len({b for _, ids in self.pins for b in ids}), "pinned count is not the pinned paths"
        for _, ids in self.pins:  # a pinned prefix is still in the tree, holding what it held
            assert all(b in self.holds for b in ids)

    def teardown(self):
        """Every pin released, nothing stays pinned or locked by pins: pins never leak."""
        for node, _ in self.pins:
            self.cache.unpin(node)
        for node, _ in self.locks:
            self.cache.unlock(node)
        self.cache.check_invariants()
        s = self.cache.stats()
        assert s.pinned_blocks == 0 and s.in_use_blocks == len(self.owned)


class LFUCollidingRadixCacheMachine(RadixCacheMachine):
    """Same, with LFU eviction and hashes truncated to 2 bits so that keys collide all the time."""

    policy = "lfu"
    hash_bits = 2


SETTINGS = settings(max_examples=200, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("machine", [RadixCacheMachine, LFUCollidingRadixCacheMachine], ids=["lru", "lfu-2bit-hash"])
def test_random_interleavings_keep_the_cache_consistent(machine):
    run_state_machine_as_test(machine, settings=SETTINGS)
