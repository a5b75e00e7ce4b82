"""The chunk index: identities depend on a chunk's own tokens, the model and the namespace, never on its
position."""
from __future__ import annotations

from blend.chunk_index import ChunkIndex
from radix import RadixCache
from reuse_server.kv.block_manager import BlockManager

BS = 4


def index(num_blocks=64, min_tokens=4, cache=None) -> ChunkIndex:
    # the block manager files the chunks: the one code that changes the radix tree
    return ChunkIndex(BlockManager(cache or RadixCache(num_blocks, BS), BS), BS, pad_token=1000, min_tokens=min_tokens)


def store(idx: ChunkIndex, tokens, salt=b"", alone=True):
    filled = []
    assert idx.store(tokens, filled.extend, salt, alone)
    return filled


def test_store_frees_what_the_tree_already_holds_and_says_when_there_is_no_room():
    idx = index(num_blocks=6)
    chunk = list(range(10, 21))  # 3 blocks
    store(idx, chunk)
    store(idx, chunk)  # the same identity again: the second copy's blocks go back
    stats = idx.blocks.cache.stats()
    assert stats.cached_blocks == 3 and stats.in_use_blocks == 0
    idx.hold(idx.lookup(chunk))
    assert not idx.store(list(range(30, 47)), lambda blocks: None)  # 5 blocks, 3 free, the rest held
    assert idx.blocks.cache.stats().in_use_blocks == 3  # only the held hit


def test_whole_chunk_including_its_partial_tail_is_found():
    idx = index()
    chunk = list(range(10, 21))  # 11 tokens: two full blocks and a padded tail
    blocks = store(idx, chunk)
    hit = idx.lookup(chunk)
    assert hit.num_tokens == 11 and hit.block_ids == blocks
    assert idx.contains(chunk)


def test_namespace_and_model_separate_equal_tokens():
    idx = index()
    chunk = list(range(10, 22))
    store(idx, chunk, b"tenant-a")
    assert idx.lookup(chunk, b"tenant-b") is None
    assert idx.lookup(chunk) is None
    assert idx.contains(chunk, b"tenant-a")
    # another model's cache (another identity) names the same chunk differently
    ours = index(cache=RadixCache(64, BS, identity=b"model-a"))
    theirs = index(cache=RadixCache(64, BS, identity=b"model-b"))
    store(ours, chunk)
    store(theirs, chunk)
    key = lambda idx: idx.blocks.cache.hasher.hash_blocks(idx.padded(chunk), idx.chunk_namespace())
    assert key(ours) != key(theirs) and ours.lookup(chunk) is not None


def test_a_chunk_sharing_only_a_beginning_reuses_its_full_blocks():
    idx = index()
    store(idx, list(range(10, 23)))
    hit = idx.lookup(list(range(10, 18)) + [99, 98, 97])
    assert hit.num_tokens == 8  # two full blocks; the padded tail only matches the whole chunk
    assert not idx.contains(list(range(10, 18)) + [99, 98, 97])


def test_chunks_below_the_minimum_are_ignored_and_prompts_never_collide_with_chunks():
    idx = index(min_tokens=6)
    assert idx.lookup([1, 2, 3]) is None
    chunk = list(range(30, 38))
    idx.blocks.cache.insert(chunk, idx.blocks.cache.allocate(2))  # the same tokens as an ordinary prompt
    assert idx.lookup(chunk) is None


def test_chunk_blocks_are_evictable_in_the_one_accounting():
    idx = index(num_blocks=6)
    store(idx, list(range(10, 22)))  # 3 blocks
    s = idx.blocks.cache.stats()
    assert s.evictable_blocks == 3 and s.free_blocks == 3
    idx.blocks.cache.allocate(5)  # needs two of the chunk's blocks back
    assert idx.lookup(list(range(10, 22))) is None or not idx.contains(list(range(10, 22)))
    assert idx.blocks.cache.stats().evicted_blocks >= 2


def test_alone_and_in_context_forms_are_filed_apart_and_the_alone_one_wins_a_tie():
    idx = index()
    chunk = list(range(10, 21))
    ctx_blocks = store(idx, chunk, alone=False)
    hit = idx.lookup(chunk)
    assert hit.block_ids == ctx_blocks and not hit.alone
    assert idx.contains(chunk) and idx.contains(chunk, alone=False) and not idx.contains(chunk, alone=True)
    alone_blocks = store(idx, chunk, alone=True)
    assert set(alone_blocks).isdisjoint(ctx_blocks)
    hit = idx.lookup(chunk)
    assert hit.block_ids == alone_blocks and hit.alone
    assert idx.lookup(chunk, alone=False).block_ids == ctx_blocks
    idx.blocks.cache.check_invariants()


def test_the_longer_match_wins_whatever_its_form():
    idx = index()
    store(idx, list(range(10, 18)) + [50, 51, 52], alone=True)  # shares only the first two blocks
    ctx_blocks = store(idx, list(range(10, 21)), alone=False)
    hit = idx.lookup(list(range(10, 21)))
    assert hit.num_tokens == 11 and hit.block_ids == ctx_blocks and not hit.alone
