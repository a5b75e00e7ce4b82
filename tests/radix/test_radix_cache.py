"""RadixCache: matching, inserting, block accounting, locks, eviction policies, stats, collisions, salts."""
import dataclasses

import numpy as np
import pytest

from radix import OutOfBlocks, RadixCache, RadixError, file_blocks, publish

BS = 4


def blocks(*values):
    """A prompt of one block per value: block i is BS copies of values[i]."""
    return [v for v in values for _ in range(BS)]


class Removals:
    """A cache listener that keeps the ids of removed blocks."""

    def __init__(self):
        self.ids = []

    def stored(self, records):
        pass

    def removed(self, records):
        self.ids.extend(r.block_id for r in records)


def cache_prompt(cache, tokens, namespace=b""):
    """What an engine does for one request: match, lock, allocate the rest, publish (insert, move the lock to
    the chain's end), keep it locked."""
    m = cache.match(tokens, namespace)
    cache.lock(m.node)
    new = cache.allocate(len(tokens) // cache.block_size - len(m.block_ids))
    r = publish(cache, tokens, m.block_ids + new, namespace, m.node)
    assert r.duplicate_block_ids == [] and r.inserted_block_ids == new
    return r.node, m.block_ids + new


def test_match_returns_cached_prefix_and_partial_block_is_never_shared():
    cache = RadixCache(16, block_size=BS)
    prompt = blocks(1, 2, 3) + [7, 7]  # 3 full blocks and a partial one
    assert cache.match(prompt).block_ids == []
    node, ids = cache_prompt(cache, prompt)
    assert len(ids) == 3
    m = cache.match(prompt)
    assert (m.block_ids, m.num_tokens, m.node) == (ids, 3 * BS, node)
    m = cache.match(blocks(1, 2, 9))
    assert (m.block_ids, m.num_tokens) == (ids[:2], 2 * BS)
    m = cache.match(blocks(1, 2) + [3, 3, 3])  # third block only partly there: not matched
    assert m.block_ids == ids[:2]
    cache.check_invariants()


def test_insert_ignores_partial_block_ids_which_stay_with_the_caller():
    cache = RadixCache(8, block_size=BS)
    ids = cache.allocate(3)
    r = cache.insert(blocks(1, 2) + [5], ids)
    assert r.inserted_block_ids == ids[:2]
    cache.free([ids[2]])  # still caller-owned
    with pytest.raises(ValueError, match="not caller-owned"):
        cache.free([ids[0]])  # now the tree's
    cache.check_invariants()


def test_insert_reports_duplicates_and_skips_the_trees_own_blocks():
    cache = RadixCache(16, block_size=BS)
    prompt = blocks(1, 2, 3)
    first, second = cache.allocate(3), cache.allocate(3)  # two requests computed the same prompt
    r1 = cache.insert(prompt, first)
    assert r1.inserted_block_ids == first and r1.duplicate_block_ids == []
    r2 = cache.insert(prompt, second)
    assert r2.duplicate_block_ids == second and r2.inserted_block_ids == [] and r2.node is r1.node
    cache.free(r2.duplicate_block_ids)
    # the engine's usual path: the matched prefix is the tree's own, only the tail is new
    m = cache.match(blocks(1, 2, 3, 4, 5))
    tail = cache.allocate(2)
    r3 = cache.insert(blocks(1, 2, 3, 4, 5), m.block_ids + tail)
    assert r3.duplicate_block_ids == [] and r3.inserted_block_ids == tail
    assert cache.match(blocks(1, 2, 3, 4, 5)).block_ids == first + tail
    cache.check_invariants()


def test_publishing_a_chain_filed_meanwhile_frees_the_duplicates_and_moves_the_hold_to_the_trees_copy():
    """radix.publish, as the engine's block manager and the offline replay call it: two requests computed the
    same prompt past a shared prefix; the second one's blocks go back, and each request then holds (locks)
    exactly its chain's end in the tree, its old hold let go."""
    cache = RadixCache(16, block_size=BS)
    prefix_node, prefix = cache_prompt(cache, blocks(1))
    held = []
    for _ in range(2):
        m = cache.match(blocks(1, 2, 3))
        cache.lock(m.node)
        held.append((m, cache.allocate(2)))
    cache.unlock(prefix_node)  # only the two requests hold the prefix now
    seen = []
    first = publish(cache, blocks(1, 2, 3), held[0][0].block_ids + held[0][1], b"", held[0][0].node)
    second = publish(cache, blocks(1, 2, 3), held[1][0].block_ids + held[1][1], b"", held[1][0].node,
                     before_freeing=lambda result: seen.append(list(result.duplicate_block_ids)))
    assert first.inserted_block_ids == held[0][1] and second.duplicate_block_ids == held[1][1] == seen[0]
    assert second.node is first.node and first.node.lock_ref == 2
    s = cache.stats()
    assert (s.cached_blocks, s.in_use_blocks, s.free_blocks) == (3, 3, 13)  # the duplicates are free again
    cache.unlock(first.node)
    cache.unlock(second.node)
    assert cache.stats().evictable_blocks == 3
    with pytest.raises(RadixError, match="not locked"):
        cache.unlock(prefix_node)  # every hold on the prefix moved down the chain and was let go there
    # file_blocks alone (blocks no request computed, as a tier's or a chunk's): no hold is taken
    stored = file_blocks(cache, blocks(7, 8), cache.allocate(2))
    assert stored.node.lock_ref == 0 and cache.stats().in_use_blocks == 0
    cache.check_invariants()


def test_chain_starts_are_the_offsets_where_a_chain_of_the_namespaces_asked_begins():
    cache = RadixCache(32, block_size=BS)
    file_blocks(cache, blocks(5, 6), cache.allocate(2), b"chunk")
    file_blocks(cache, blocks(7), cache.allocate(1), b"other-chunk")
    file_blocks(cache, blocks(8), cache.allocate(1), b"prompt")
    prompt = [1, 2] + blocks(5, 6) + [3] + blocks(7) + blocks(8) + [9]
    assert cache.chain_starts(prompt, [b"chunk"]) == [2]  # a chain's second block starts no chain
    assert cache.chain_starts(prompt, [b"chunk", b"other-chunk"]) == [2, 11]
    assert cache.chain_starts(prompt, [b"elsewhere"]) == []
    assert cache.chain_starts(prompt[:5], [b"chunk"]) == []  # no whole block of tokens at the chunk's start
    cache.check_invariants()


def test_insert_rejects_blocks_that_are_not_the_callers():
    cache = RadixCache(8, block_size=BS)
    ids = cache.allocate(2)
    cache.insert(blocks(1, 2), ids)
    with pytest.raises(ValueError, match="not caller-owned"):
        cache.insert(blocks(3, 4), ids)  # the tree's blocks at other positions
    with pytest.raises(ValueError, match="is free"):
        cache.insert(blocks(5), [7])
    with pytest.raises(ValueError, match="block ids"):
        cache.insert(blocks(5, 6), [0])
    cache.check_invariants()


def test_accounting_states_add_up_and_locks_move_blocks_between_evictable_and_in_use():
    cache = RadixCache(10, block_size=BS)
    node, ids = cache_prompt(cache, blocks(1, 2, 3))
    s = cache.stats()
    assert (s.free_blocks, s.evictable_blocks, s.in_use_blocks, s.cached_blocks) == (7, 0, 3, 3)
    cache.unlock(node)
    s = cache.stats()
    assert (s.free_blocks, s.evictable_blocks, s.in_use_blocks) == (7, 3, 0)
    assert cache.num_allocatable() == 10
    held = cache.allocate(2)
    assert cache.stats().in_use_blocks == 2
    cache.free(held)
    assert dataclasses.asdict(cache.stats())["free_blocks"] == 7
    with pytest.raises(RadixError, match="not locked"):
        cache.unlock(node)
    cache.check_invariants()


def test_allocate_takes_free_blocks_first_then_evicts_and_never_evicts_locked_blocks():
    listener = Removals()
    evicted = listener.ids
    cache = RadixCache(6, block_size=BS, listener=listener)
    locked_node, locked_ids = cache_prompt(cache, blocks(1, 2))
    node, other_ids = cache_prompt(cache, blocks(3, 4))
    cache.unlock(node)
    assert cache.allocate(2) and evicted == []  # free blocks suffice
    with pytest.raises(OutOfBlocks, match="needed 3, available 2"):
        cache.allocate(3)
    assert cache.stats().free_blocks == 0  # all or nothing: nothing taken
    got = cache.allocate(2)
    assert sorted(got) == sorted(other_ids) and sorted(evicted) == sorted(other_ids)
    assert cache.match(blocks(1, 2)).block_ids == locked_ids
    assert cache.stats().evicted_blocks == 2
    cache.check_invariants()


def test_eviction_removes_leaves_first_and_a_parent_once_its_last_child_is_gone():
    cache = RadixCache(10, block_size=BS)
    a, a_ids = cache_prompt(cache, blocks(1, 2))
    b, b_ids = cache_prompt(cache, blocks(1, 2, 3))
    c, c_ids = cache_prompt(cache, blocks(1, 2, 4, 5))
    for node in (a, b, c):
        cache.unlock(node)
    cache.match(blocks(1, 2, 4, 5))  # the newest: LRU evicts the other leaf first
    assert cache.evict(1) == [b_ids[2]]
    assert cache.evict(1) == [c_ids[3]]  # a leaf bigger than needed loses only its last block
    assert cache.evict(1) == [c_ids[2]]
    assert cache.match(blocks(1, 2, 4, 5)).block_ids == a_ids  # the shared parent stayed until now
    assert sorted(cache.evict(5)) == sorted(a_ids)
    assert cache.stats().evictable_blocks == 0 and cache.evict(3) == []
    cache.check_invariants()


@pytest.mark.parametrize("policy, expected_order", [("lru", [1, 3, 2]), ("lfu", [2, 3, 1])])
def test_policies_choose_different_victims(policy, expected_order):
    cache = RadixCache(3, block_size=BS, policy=policy)
    owner = {}
    for value in (1, 2, 3):
        node, ids = cache_prompt(cache, blocks(value))
        cache.unlock(node)
        owner[ids[0]] = value
    for value, times in ((1, 3), (3, 2), (2, 1)):  # 1 most often, 2 most recently
        for _ in range(times):
            cache.match(blocks(value))
    assert [owner[cache.evict(1)[0]] for _ in range(3)] == expected_order


def test_split_keeps_locks_exact():
    cache = RadixCache(10, block_size=BS)
    node, ids = cache_prompt(cache, blocks(1, 2, 3, 4))  # one node of 4 blocks, locked
    m = cache.match(blocks(1, 2, 9))  # splits it after 2 blocks
    assert m.block_ids == ids[:2]
    cache.check_invariants()
    cache.lock(m.node)
    cache.unlock(node)  # the request holding the whole chain ends
    s = cache.stats()
    assert (s.in_use_blocks, s.evictable_blocks) == (2, 2)
    assert sorted(cache.evict(10)) == sorted(ids[2:])
    cache.unlock(m.node)
    assert sorted(cache.evict(10)) == sorted(ids[:2])
    cache.check_invariants()


def test_an_evicted_node_cannot_be_locked():
    cache = RadixCache(4, block_size=BS)
    node, _ = cache_prompt(cache, blocks(1))
    cache.unlock(node)
    cache.evict(1)
    with pytest.raises(RadixError, match="not in this cache"):
        cache.lock(node)


def test_stats_count_queries_and_hits_in_tokens():
    cache = RadixCache(8, block_size=BS)
    node, _ = cache_prompt(cache, blocks(1, 2))  # one query of 8 tokens, no hit
    cache.match(blocks(1, 2, 3) + [1])  # 13 tokens, 8 hit
    cache.match(blocks(1, 2), record_stats=False)
    s = cache.stats()
    assert (s.query_tokens, s.hit_tokens) == (8 + 13, 8)
    assert s.token_hit_rate == pytest.approx(8 / 21)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_forced_hash_collisions_never_return_wrong_blocks(algo):
    rng = np.random.default_rng(1)
    cache = RadixCache(400, block_size=2, hash_algo=algo, hash_bits=2)  # 4 distinct hashes: collisions galore
    expected = {}  # full-prefix tuple -> block id of its last block
    for _ in range(60):
        prompt = rng.integers(0, 3, 2 * rng.integers(1, 5)).tolist()
        node, ids = cache_prompt(cache, prompt)
        cache.unlock(node)
        for i, block in enumerate(ids):
            assert expected.setdefault(tuple(prompt[: 2 * (i + 1)]), block) == block
        cache.check_invariants()
    for prefix, block in expected.items():
        m = cache.match(list(prefix))
        assert m.block_ids[-1] == block and m.num_tokens == len(prefix)
        assert m.block_ids == [expected[prefix[: 2 * (i + 1)]] for i in range(len(prefix) // 2)]
    buckets, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        buckets += node.children.values()
        stack += [child for bucket in node.children.values() for child in bucket]
    assert max(map(len, buckets)) > 1, "the test must actually produce colliding siblings"


@pytest.mark.parametrize("hash_bits", [None, 1])
def test_salts_isolate_equal_tokens(hash_bits):
    cache = RadixCache(16, block_size=BS, hash_bits=hash_bits)
    prompt = blocks(1, 2, 3)
    _, ids_a = cache_prompt(cache, prompt, namespace=b"tenant-a")
    _, ids_b = cache_prompt(cache, prompt, namespace=b"tenant-b")  # no duplicates (asserted inside)
    assert not set(ids_a) & set(ids_b)
    assert cache.match(prompt, namespace=b"tenant-a").block_ids == ids_a
    assert cache.match(prompt, namespace=b"tenant-b").block_ids == ids_b
    assert cache.match(prompt).block_ids == []
    assert cache.match(prompt, namespace=b"tenant-c").block_ids == []
    cache.check_invariants()


def test_reset_prefix_cache_empties_an_unlocked_tree():
    listener = Removals()
    evicted = listener.ids
    cache = RadixCache(8, block_size=BS, listener=listener)
    node, ids = cache_prompt(cache, blocks(1, 2))
    assert cache.reset_prefix_cache() is False  # a running request holds it
    cache.unlock(node)
    assert cache.reset_prefix_cache() is True and sorted(evicted) == sorted(ids)
    assert cache.stats().free_blocks == 8


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="power of two"):
        RadixCache(8, block_size=3)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixCache(8, policy="random")
    with pytest.raises(ValueError, match="num_blocks"):
        RadixCache(-1)
    cache = RadixCache(8, block_size=BS)
    with pytest.raises(TypeError, match="namespace must be bytes"):
        cache.match(blocks(1), namespace="salt")
    with pytest.raises(ValueError, match="same block id twice"):
        cache.free([0, 0])


def file_tail(cache, node, tokens):
    (block,) = cache.allocate(1)
    return cache.insert_tail(node, tokens, block), block


def test_a_tail_or_a_child_block_serves_the_tokens_a_prompt_shares_with_it():
    cache = RadixCache(16, block_size=BS)
    node, ids = cache_prompt(cache, blocks(1, 2))
    tail, tail_block = file_tail(cache, node, [5, 6, 7])
    assert tail is not None
    cache.check_invariants()
    for rest, shared in [([5, 6, 7, 8], 3), ([5, 6, 9], 2), ([5], 1), ([5, 6, 7] + blocks(4), 3)]:
        m = cache.match(blocks(1, 2) + rest)
        assert m.num_tokens == 2 * BS
        t = cache.match_partial(m.node, (blocks(1, 2) + rest)[m.num_tokens:])
        assert (t.block_id, t.num_tokens, t.node) == (tail_block, shared, tail)
    assert cache.match_partial(node, [6, 5]) is None  # the first token differs
    assert cache.match_partial(node, []) is None
    # Where the prompt leaves the chain inside a full block, that block serves its shared tokens too.
    m = cache.match(blocks(1) + [2, 2, 9])
    p = cache.match_partial(m.node, (blocks(1) + [2, 2, 9])[m.num_tokens:])
    assert (p.block_id, p.num_tokens) == (ids[1], 2)
    assert cache.match_partial(m.node, [3]) is None
    # At the root, only blocks cached under the same namespace (salt) count.
    assert cache.match_partial(cache.root, [1, 1])[2] == 2
    assert cache.match_partial(cache.root, [1, 1], b"tenant-b") is None


def test_tails_that_a_longer_one_extends_are_dropped_and_covered_ones_rejected():
    cache = RadixCache(16, block_size=BS)
    node, _ = cache_prompt(cache, blocks(1))
    short, short_block = file_tail(cache, node, [5])
    other, _ = file_tail(cache, node, [6, 6])
    locked_short, _ = file_tail(cache, node, [7])
    cache.lock(locked_short)
    longer, longer_block = file_tail(cache, node, [5, 6, 7])
    assert longer is not None and not short.attached and cache.stats().free_blocks >= 1
    assert other.attached  # not a start of the new tail: kept
    covered, covered_block = file_tail(cache, node, [5, 6])
    assert covered is None  # [5, 6, 7] already serves it; the block stays the caller's
    cache.free([covered_block])
    deeper, _ = cache_prompt(cache, blocks(1, 2))
    served, served_block = file_tail(cache, node, [2, 2])
    assert served is None  # the child block [2, 2, 2, 2] already holds these tokens' KV
    cache.free([served_block])
    kept_locked, _ = file_tail(cache, node, [7, 1])
    assert locked_short.attached and kept_locked is not None  # a locked tail is never dropped
    cache.check_invariants()
    t = cache.match_partial(node, [5, 6, 7, 1])
    assert (t.block_id, t.num_tokens) == (longer_block, 3)


def test_tails_are_evicted_before_their_chain_and_never_while_locked():
    cache = RadixCache(3, block_size=BS)
    node, (chain_block,) = cache_prompt(cache, blocks(1))
    tail, tail_block = file_tail(cache, node, [5, 6])
    cache.unlock(node)
    s = cache.stats()
    assert (s.evictable_blocks, s.in_use_blocks) == (2, 0)
    assert cache.evict(1) == [tail_block]  # the chain is not a leaf while its tail is there
    assert not tail.attached
    _, _ = cache_prompt(cache, blocks(1))  # lock the chain again
    tail, tail_block = file_tail(cache, node, [5, 6])
    cache.lock(tail)
    cache.unlock(node)  # the tail's lock still holds the whole path
    with pytest.raises(OutOfBlocks):
        cache.allocate(2)
    assert tail.attached and cache.match(blocks(1)).block_ids == [chain_block]
    cache.unlock(tail)
    cache.check_invariants()


def test_bad_tails_are_clear_errors():
    cache = RadixCache(8, block_size=BS)
    node, ids = cache_prompt(cache, blocks(1))
    (block,) = cache.allocate(1)
    with pytest.raises(ValueError, match="1 to 3 tokens"):
        cache.insert_tail(node, [5, 6, 7, 8], block)
    with pytest.raises(ValueError, match="1 to 3 tokens"):
        cache.insert_tail(node, [], block)
    with pytest.raises(ValueError, match="at least one full block"):
        cache.insert_tail(cache.root, [5], block)
    with pytest.raises(ValueError, match="not caller-owned"):
        cache.insert_tail(node, [5], ids[0])
    cache.check_invariants()
