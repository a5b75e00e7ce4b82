"""Property tests: random interleavings of match / insert / tails / lock / unlock / allocate / free / evict.

After every step the cache's own invariant check must pass (free + evictable + in use == total, no
block in two states, counters and eviction queue agree with the tree), locked blocks must never have
been evicted, and every match must return exactly the longest cached prefix, each block holding
KV for the very tokens (and extra) of the prompt. A reference model tracks what each tree block holds.
"""
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
extras = st.sampled_from([b"", b"tenant-b"])


class RadixCacheMachine(RuleBasedStateMachine):
    policy = "lru"
    hash_bits = None

    @initialize()
    def setup(self):
        self.cache = RadixCache(NUM_BLOCKS, block_size=BS, policy=self.policy, hash_bits=self.hash_bits,
                                on_evict=self.on_evict)
        self.holds = {}  # tree block id -> (extra, tokens of the whole prefix through that block)
        self.locks = []  # (node, block ids on its path) per outstanding lock
        self.owned = []  # caller-owned block ids
        self.filed = []  # (prompt, extra) of requests that filed a tail
        self.partial_hits = 0

    def on_evict(self, block_ids):
        locked = {b for _, ids in self.locks for b in ids}
        assert not locked & set(block_ids), "a locked block was evicted"
        for block in block_ids:
            del self.holds[block]

    def expected_match(self, prompt, extra):
        n = 0
        while n < len(prompt) // BS and (extra, tuple(prompt[: (n + 1) * BS])) in self.holds.values():
            n += 1
        return n

    def check_match(self, m, prompt, extra):
        assert m.num_tokens == len(m.block_ids) * BS == self.expected_match(prompt, extra) * BS
        for i, block in enumerate(m.block_ids):
            assert self.holds[block] == (extra, tuple(prompt[: (i + 1) * BS])), "match returned wrong KV"

    @rule(prompt=prompts, extra=extras, lock=st.booleans())
    def match(self, prompt, extra, lock):
        m = self.cache.match(prompt, extra)
        self.check_match(m, prompt, extra)
        if lock:
            self.cache.lock(m.node)
            self.locks.append((m.node, list(m.block_ids)))

    def serve(self, prompt, extra, spare=0):
        """The engine's path: match, lock, allocate the missing full blocks (and `spare` more), insert the
        full ones, lock the new chain instead of the match. None (nothing held) when the pool is full."""
        m = self.cache.match(prompt, extra, record_stats=False)
        self.check_match(m, prompt, extra)
        self.cache.lock(m.node)
        need = len(prompt) // BS - len(m.block_ids) + spare
        try:
            new = self.cache.allocate(need)
        except OutOfBlocks:
            assert need > self.cache.num_allocatable()
            self.cache.unlock(m.node)
            return None
        inserted = new[: len(new) - spare]
        r = self.cache.insert(prompt, m.block_ids + inserted, extra)
        assert r.duplicate_block_ids == [] and r.inserted_block_ids == inserted
        for i, block in enumerate(inserted, len(m.block_ids)):
            self.holds[block] = (extra, tuple(prompt[: (i + 1) * BS]))
        self.cache.lock(r.node)
        self.cache.unlock(m.node)
        return m.block_ids + new, r.node

    @rule(prompt=prompts, extra=extras, keep_locked=st.booleans())
    def run_request(self, prompt, extra, keep_locked):
        served = self.serve(prompt, extra)
        if served is None:
            return
        blocks, node = served
        if keep_locked:
            self.locks.append((node, blocks))
        else:
            self.cache.unlock(node)

    @rule(prompt=prompts, extra=extras)
    def insert_own_blocks(self, prompt, extra):
        """A request that computed its whole prompt into its own blocks (e.g. raced another one)."""
        n = len(prompt) // BS
        if n > len(self.owned):
            return
        given, self.owned = self.owned[:n], self.owned[n:]
        cached = self.expected_match(prompt, extra)
        r = self.cache.insert(prompt, given, extra)
        assert r.duplicate_block_ids == given[:cached] and r.inserted_block_ids == given[cached:]
        for i, block in enumerate(r.inserted_block_ids, cached):
            self.holds[block] = (extra, tuple(prompt[: (i + 1) * BS]))
        self.owned += r.duplicate_block_ids

    @rule(prompt=prompts, extra=extras, lock_tail=st.booleans(), chain_locked=st.booleans())
    def finish_request(self, prompt, extra, lock_tail, chain_locked):
        """The engine's path when a request ends: its full blocks go into the tree, its partial last block
        becomes a tail of that chain."""
        full = len(prompt) // BS
        partial = len(prompt) > full * BS
        served = self.serve(prompt, extra, spare=int(partial))
        if served is None:
            return
        blocks, chain = served
        if not chain_locked:  # the chain may be an evictable leaf when the tail arrives
            self.cache.unlock(chain)
        if partial and full:
            key, block = (extra, tuple(prompt)), blocks[full]
            # Already served: the same tail (BS 2: a tail is one token), or a full block that starts with it.
            known = any(e == extra and t[: len(prompt)] == key[1] and len(t) in (len(prompt), (full + 1) * BS)
                        for e, t in self.holds.values())
            tail = self.cache.insert_tail(chain, prompt[full * BS:], block)
            assert (tail is None) == known
            if tail is None:
                self.cache.free([block])
            else:
                self.holds[block] = key
                self.filed.append((prompt, extra))
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
        prompt, extra = data.draw(st.sampled_from(self.filed))
        if change_last:
            prompt = prompt[:-1] + [1 - prompt[-1]]
        prompt = prompt + data.draw(st.lists(st.integers(0, 1), max_size=BS))
        m = self.cache.match(prompt, extra, record_stats=False)
        self.check_match(m, prompt, extra)
        n = m.num_tokens
        p = self.cache.match_partial(m.node, prompt[n:], extra)
        want = tuple(prompt[: n + 1])
        servable = [b for b, (e, t) in self.holds.items() if e == extra and len(t) in (n + 1, n + BS) and t[: n + 1] == want]
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

    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict(self, n):
        evictable = self.cache.stats().evictable_blocks
        assert len(self.cache.evict(n)) == min(n, evictable)

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        s = self.cache.stats()
        assert s.free_blocks + s.evictable_blocks + s.in_use_blocks == s.total_blocks
        assert s.cached_blocks == len(self.holds)
        assert s.in_use_blocks >= len(self.owned) + len({b for _, ids in self.locks for b in ids})


class LFUCollidingRadixCacheMachine(RadixCacheMachine):
    """Same, with LFU eviction and hashes truncated to 2 bits so that keys collide all the time."""

    policy = "lfu"
    hash_bits = 2


SETTINGS = settings(max_examples=200, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("machine", [RadixCacheMachine, LFUCollidingRadixCacheMachine], ids=["lru", "lfu-2bit-hash"])
def test_random_interleavings_keep_the_cache_consistent(machine):
    run_state_machine_as_test(machine, settings=SETTINGS)
