"""The window parts of a hybrid pool (kv/window_parts.py) under the block manager, with no model: a two-layer
LayeredKVPool (layer 0 full attention, layer 1 a window of 8 tokens over blocks of 4), each token's KV
written as (token, position) in both layers, so that what a query would read through its block table says
whether the window layer holds the right tokens.

The properties, after every operation of a random schedule (admit, compute a slice, finish, over prompts
that share prefixes, in a pool and a window pool small enough to evict):
- the accounting of parts, blocks and the tree holds (check_invariants);
- every running sequence's window (the keys its next query sees) has parts, pinned, holding its own tokens
  at their positions, and its full-attention layer holds all of its computed tokens;
- a finished sequence pins nothing; when all have finished, no part is pinned."""
from __future__ import annotations

import random

import pytest
import torch

from radix import Listeners, RadixCache
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.engine.sequence import Sequence
from reuse_server.kv.block_manager import BlockManager
from reuse_server.kv.layered_pool import LayeredKVPool

BS = 4
WINDOW = 8


class Rig:
    def __init__(self, num_blocks: int, num_window_blocks: int):
        self.pool = LayeredKVPool((None, WINDOW), num_blocks, num_window_blocks, BS, num_kv_heads=1, head_dim=2)
        self.listeners = Listeners()
        self.cache = RadixCache(num_blocks, BS, identity=b"unit", listener=self.listeners)
        self.blocks = BlockManager(self.cache, BS, True, self.pool.copy_blocks, self.pool.clear_blocks,
                                   window=self.pool.window_policy())
        self.listeners.listeners.append(self.blocks)
        self.ids = 0

    def seq(self, prompt: list[int]) -> Sequence:
        self.ids += 1
        return Sequence(f"r{self.ids}", list(prompt), SamplingParams(max_tokens=4), CacheOptions())

    def compute(self, seq: Sequence, n: int) -> bool:
        start = seq.num_computed
        n = min(n, self.blocks.computable(seq))
        if not self.blocks.ensure_capacity(seq, start + n):
            return False
        positions = torch.arange(start, start + n)
        slots = torch.tensor([seq.block_table[p // BS] * BS + p % BS for p in positions.tolist()], dtype=torch.long)
        kv = kv_of(seq.token_ids[start:start + n], positions)
        for layer in (0, 1):
            self.pool.write(layer, slots, kv, torch.zeros(n, 1, 2))
        self.blocks.advance(seq, n)
        return True

    def check(self, running: list[Sequence]) -> None:
        self.cache.check_invariants()
        self.pool.parts.check_invariants()
        parts = self.pool.parts
        for seq in running:
            c = seq.num_computed
            if not c:
                continue
            table = torch.tensor(seq.block_table)
            want = kv_of(seq.token_ids[:c], torch.arange(c))
            assert torch.equal(self.pool.full.gather(0, table, c)[0], want)
            first = max(0, c - WINDOW + 1)  # the next query (at position c) sees keys first .. c
            for index in range(first // BS, -(-c // BS)):
                assert parts.has(seq.block_table[index]), (seq.request_id, index)
            window_table = parts.table[table]
            keys = self.pool.windowed.gather(0, window_table, c)[0]
            assert torch.equal(keys[first:c], want[first:c])


def kv_of(tokens: list[int], positions: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.tensor(tokens, dtype=torch.float32), positions.float()], -1).view(-1, 1, 2)


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_keep_every_window_whole_and_give_parts_back(seed):
    rng = random.Random(20261202 + seed)
    print(f"seed {20261202 + seed}")
    rig = Rig(num_blocks=rng.choice([24, 40, 64]), num_window_blocks=rng.choice([10, 14, 24]))
    stems = [[rng.randrange(1, 30) for _ in range(rng.randrange(4, 40))] for _ in range(3)]
    running: list[Sequence] = []
    finished = []
    for _ in range(120):
        action = rng.random()
        if action < 0.3 and len(running) < 2:
            stem = rng.choice(stems + [s.token_ids for s in finished[-3:]])
            seq = rig.seq(stem[:rng.randrange(0, len(stem) + 1)] + [rng.randrange(1, 30)
                                                                     for _ in range(rng.randrange(1, 20))])
            if rig.blocks.admit(seq, rng.randrange(1, 9)) is not None:
                running.append(seq)
        elif action < 0.85 and running:
            seq = rng.choice(running)
            if seq.num_computed < seq.num_tokens:
                rig.compute(seq, rng.randrange(1, 9))
            else:  # decode: a sampled token, then its KV
                seq.output_ids.append(rng.randrange(1, 30))
                rig.compute(seq, 1)
        elif running:
            seq = running.pop(rng.randrange(len(running)))
            if seq.num_computed:
                finished.append(seq)
            rig.blocks.release(seq)
            assert not seq.block_table
        rig.check(running)
    for seq in running:
        rig.blocks.release(seq)
    rig.check([])
    stats = rig.pool.parts.stats()
    assert stats["window_blocks_pinned"] == 0
    print(stats)


def test_a_long_sequence_pins_only_its_window_and_the_tree_keeps_the_last_one():
    rig = Rig(num_blocks=64, num_window_blocks=8)  # 7 parts: 28 tokens of window-layer KV
    seq = rig.seq([(7 * i) % 29 + 1 for i in range(100)])
    assert rig.blocks.admit(seq, 4) is not None
    while seq.num_computed < seq.num_tokens:
        assert rig.compute(seq, 4)
        rig.check([seq])
        assert rig.pool.parts.stats()["window_blocks_pinned"] <= WINDOW // BS + 2
    rig.blocks.release(seq)
    rig.check([])
    stats = rig.pool.parts.stats()
    assert stats["window_blocks_pinned"] == 0 and stats["window_blocks_cached"] > 0
    # the same prompt again: the whole chain but its last token is served, its window cached
    again = rig.seq(seq.token_ids + [5])
    assert rig.blocks.admit(again, 4).cached_tokens == 100
    rig.check([again])
    rig.blocks.release(again)


def test_a_chain_whose_window_parts_were_evicted_is_matched_only_where_a_window_is_whole():
    rig = Rig(num_blocks=64, num_window_blocks=8)
    first = rig.seq([(3 * i) % 29 + 1 for i in range(40)])
    other = rig.seq([(5 * i) % 23 + 2 for i in range(40)])  # needs the parts first left cached
    for seq in (first, other):
        assert rig.blocks.admit(seq, 4) is not None
        while seq.num_computed < seq.num_tokens:
            assert rig.compute(seq, 4)
        rig.blocks.release(seq)
    assert rig.pool.parts.evicted > 0
    assert rig.cache.match(first.token_ids, b"", record_stats=False).num_tokens == 40  # full layer: all there
    again = rig.seq(first.token_ids + [9])
    admission = rig.blocks.admit(again, 4)
    assert admission.cached_tokens < 40
    rig.check([again])  # what it matched has its window: its next query reads the right keys
    while again.num_computed < again.num_tokens:
        assert rig.compute(again, 4)
        rig.check([again])
    rig.blocks.release(again)
    rig.check([])


def test_a_pinned_prefix_keeps_the_window_parts_a_hit_needs_until_its_pin_ends():
    """Prompt-cache pins on a hybrid pool: the window before the breakpoint keeps its parts while other prompts
    take every unpinned part, so a later prompt still hits the whole pinned prefix; once the pin expires
    the parts are ordinary cache again and nothing stays pinned."""
    from reuse_server.kv.pins import CacheBreakpoint

    rig = Rig(num_blocks=40, num_window_blocks=12)
    rng = random.Random(77)
    marked = [rng.randrange(1, 90) for _ in range(24)]
    seq = Sequence("pin", marked + [1, 2], SamplingParams(max_tokens=1),
                   CacheOptions(breakpoints=[CacheBreakpoint(24, 300.0)]))
    assert rig.blocks.admit(seq, 64) is not None and rig.compute(seq, 64)
    rig.blocks.pin_breakpoints(seq, now=0.0)
    rig.blocks.release(seq)
    for i in range(6):  # other prompts take the window pool's parts over and over
        other = rig.seq([rng.randrange(1, 90) for _ in range(20)])
        assert rig.blocks.admit(other, 64) is not None and rig.compute(other, 64)
        rig.blocks.release(other)
        rig.check([])
    assert rig.pool.parts.evicted > 0
    again = rig.seq(marked + [5, 6, 7])
    assert rig.blocks.admit(again, 64).cached_tokens == 24, "the window before the pinned prefix lost its parts"
    rig.blocks.release(again)
    assert rig.blocks.expire_pins(now=300.0) == 1
    rig.check([])
    assert rig.pool.parts.stats()["window_blocks_pinned"] == 0 and rig.cache.stats().in_use_blocks == 0


def test_each_pool_reports_its_own_memory_figures():
    """LLMEngine.memory asks the pool: a one-group pool counts every layer of every used block; a hybrid pool
    every used block's full-attention layers and its window layers only for the parts held (pinned or cached),
    with the parts' counts beside. Sizes from first principles: one layer's K and V of a block of BS tokens, one
    head of 2 fp32 values, is 2 * BS * 2 * 4 bytes."""
    from reuse_server.kv.pool import KVPool

    layer_block = 2 * BS * 2 * 4
    one = KVPool(2, 10, BS, num_kv_heads=1, head_dim=2).memory(used_blocks=3)
    assert (one.kv_dtype, one.bytes_per_block, one.pool_bytes, one.held_bytes, one.window) == (
        "float32", 2 * layer_block, 10 * 2 * layer_block, 3 * 2 * layer_block, {})
    rig = Rig(num_blocks=64, num_window_blocks=8)
    seq = rig.seq([(7 * i) % 29 + 1 for i in range(40)])  # 10 blocks, more than the window pool's 7 parts
    assert rig.blocks.admit(seq, 4) is not None
    while seq.num_computed < seq.num_tokens:
        assert rig.compute(seq, 4)
    used = rig.cache.stats().total_blocks - rig.cache.stats().free_blocks
    memory = rig.pool.memory(used)
    parts = rig.pool.parts.stats()
    assert 0 < parts["window_blocks_pinned"] + parts["window_blocks_cached"] < used == 10
    assert (memory.bytes_per_block, memory.pool_bytes) == (2 * layer_block, 64 * layer_block + 8 * layer_block)
    assert memory.held_bytes == used * layer_block + (parts["window_blocks_pinned"] + parts["window_blocks_cached"]) \
        * layer_block
    assert memory.window == parts
    rig.blocks.release(seq)
