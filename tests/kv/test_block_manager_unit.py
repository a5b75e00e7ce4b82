"""The block manager on a real radix cache, KV pool and host tier (or disk), with no model: the step's forward is
played by writing each token's KV as (token, position) through the pool, so every block's content says
which tokens at which positions it holds."""
from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blend.chunk_index import ChunkIndex
from radix import RadixCache
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.engine.sequence import Sequence
from reuse_server.kv.block_manager import BlockManager
from reuse_server.kv.pool import KVPool
from reuse_server.kv.tiers import BlobContext, DiskTier, HostTier, KVTiers

BS = 4
SEED = 20261201


class Rig:
    """A block manager over a pool of `num_blocks` blocks, optionally with a host RAM tier below it."""

    def __init__(self, num_blocks: int = 16, host: bool = False, disk=None):
        self.pool = KVPool(num_layers=1, num_blocks=num_blocks, block_size=BS, num_kv_heads=1, head_dim=2)
        self.tiers = None
        if host:
            self.tiers = KVTiers(self.pool, host=HostTier(10**8))
        elif disk is not None:  # a folder
            ctx = BlobContext("ab" * 16, BS, "xxh3_128", self.pool.layout.describe(), self.pool.layout.nbytes)
            self.tiers = KVTiers(self.pool, disk=DiskTier(disk, 10**8, ctx))
        self.cache = RadixCache(num_blocks, BS, identity=b"unit", listener=self.tiers)
        self.blocks = BlockManager(self.cache, BS, True, self.pool.copy_blocks, self.pool.clear_blocks, self.tiers)
        self.ids = 0

    def seq(self, prompt: list[int], **cache) -> Sequence:
        self.ids += 1
        return Sequence(f"r{self.ids}", list(prompt), SamplingParams(max_tokens=4), CacheOptions(**cache))

    def compute(self, seq: Sequence, n: int | None = None) -> None:
        """The step's forward for seq's next n tokens (up to what it may compute), then advance."""
        n = self.blocks.computable(seq) if n is None else n
        start = seq.num_computed
        assert self.blocks.ensure_capacity(seq, start + n)
        positions = torch.arange(start, start + n)
        slots = torch.tensor([seq.block_table[p // BS] * BS + p % BS for p in positions.tolist()])
        self.pool.write(0, slots, kv_of(seq.token_ids[start:start + n], positions), torch.zeros(n, 1, 2))
        self.blocks.advance(seq, n)

    def keys(self, seq: Sequence, upto: int) -> torch.Tensor:
        """The keys the pool holds for seq's positions 0..upto-1, through its block table."""
        return self.pool.gather(0, torch.tensor(seq.block_table), upto)[0]

    def accounting(self) -> None:
        s = self.cache.stats()
        assert s.free_blocks + s.evictable_blocks + s.in_use_blocks == s.total_blocks
        self.cache.check_invariants()


def kv_of(tokens: list[int], positions: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.tensor(tokens, dtype=torch.float32), positions.float()], -1).view(-1, 1, 2)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(SEED + seed)
    return [rng.randrange(1, 50) for _ in range(n)]


def test_a_second_request_shares_the_published_prefix_and_computes_only_the_rest():
    rig = Rig()
    shared = prompt(13, 0)
    a = rig.seq(shared + [7, 8])
    assert rig.blocks.admit(a, 100).cached_tokens == 0
    rig.compute(a)
    rig.blocks.release(a)
    rig.accounting()
    b = rig.seq(shared + [9, 9, 9])
    admission = rig.blocks.admit(b, 2)
    # three full blocks, locked, and the first token of a's tail (shared[12], then 7, 8): copied in
    assert admission.cached_tokens == 13 and admission.by_tier == {}
    assert rig.cache.stats().in_use_blocks == 3 + 1  # the matched blocks and b's own fourth block
    shared_blocks = b.block_table[:3]
    rig.compute(b)  # the rest of the prompt, on top of the shared blocks
    assert b.block_table[:3] == shared_blocks and b.kv.num_published == 4  # its own last block is filed now
    assert torch.equal(rig.keys(b, b.num_computed), kv_of(b.token_ids[:b.num_computed], torch.arange(b.num_computed)))
    rig.blocks.release(b)
    rig.accounting()
    assert rig.cache.stats().in_use_blocks == 0


def test_a_prompt_leaving_the_chain_inside_a_block_gets_a_copy_of_the_shared_tokens():
    rig = Rig()
    first = prompt(10, 1)
    a = rig.seq(first + [1, 2, 3, 4])
    rig.blocks.admit(a, 100)
    rig.compute(a)
    rig.blocks.release(a)  # 14 tokens computed: 3 full blocks published
    b = rig.seq(first + [1, 50, 51, 52, 53])  # a's block 2 holds first[8:10] + [1, 2]: b shares 3 of its tokens
    admission = rig.blocks.admit(b, 100)
    assert admission.cached_tokens == 8 + 3  # two full blocks, then the three shared tokens of the third
    assert b.block_table[2] in b.kv.owned  # the copy is its own block, never the tree's
    assert torch.equal(rig.keys(b, 11), kv_of(b.token_ids[:11], torch.arange(11)))
    rig.compute(b)  # from the divergence on, into the copy
    assert torch.equal(rig.keys(b, b.num_computed), kv_of(b.token_ids[:b.num_computed], torch.arange(b.num_computed)))
    rig.blocks.release(b)
    rig.accounting()
    assert rig.cache.stats().in_use_blocks == 0


def test_an_admission_the_pool_cannot_take_holds_nothing():
    rig = Rig(num_blocks=4)
    a = rig.seq(prompt(13, 2))
    rig.blocks.admit(a, 100)  # holds all four blocks
    b = rig.seq(prompt(6, 3))
    before = rig.cache.stats()
    assert rig.blocks.admit(b, 100) is None
    assert rig.cache.stats() == before and not b.block_table and b.kv.node is None
    rig.accounting()


def test_two_sequences_publishing_the_same_blocks_end_on_the_trees_copies():
    rig = Rig()
    p = prompt(9, 4)
    a, b = rig.seq(p), rig.seq(p)
    rig.blocks.admit(a, 100)
    rig.blocks.admit(b, 100)  # nothing cached yet: both compute
    rig.compute(a)
    rig.compute(b)  # b's full blocks are duplicates: freed, its table now uses a's
    assert a.block_table[:2] == b.block_table[:2]
    assert rig.cache.stats().in_use_blocks == 2 + 2  # the shared two and each one's partial third block
    for s in (a, b):
        rig.blocks.release(s)
    rig.accounting()


def test_blocks_evicted_to_host_ram_come_back_into_the_tree_through_the_block_manager():
    rig = Rig(num_blocks=16, host=True)
    p = prompt(17, 5)
    a = rig.seq(p)
    rig.blocks.admit(a, 100)
    rig.compute(a)
    want = rig.keys(a, 16)
    rig.blocks.release(a)
    assert rig.cache.reset_prefix_cache()  # every block evicted: copied to host RAM
    assert rig.tiers.host.num_blocks == 4
    b = rig.seq(p)
    admission = rig.blocks.admit(b, 100)
    assert admission.cached_tokens == 16 and admission.by_tier == {"host": 16}
    assert torch.equal(rig.keys(b, 16), want)
    assert rig.cache.match(p[:16], b"", record_stats=False).num_tokens == 16  # filed in the tree
    rig.blocks.release(b)
    rig.accounting()


def test_after_a_hole_only_the_hole_is_computed():
    rig = Rig(num_blocks=16, host=True)
    p = prompt(25, 6)  # six full matchable blocks
    a = rig.seq(p)
    rig.blocks.admit(a, 100)
    rig.compute(a)
    want = rig.keys(a, 24)
    rig.blocks.release(a)
    rig.cache.reset_prefix_cache()
    hole = rig.cache.hasher.hash_blocks(p[:24], b"")[2]
    rig.tiers.host.discard(hole)  # block 2 is in no tier
    b = rig.seq(p)
    admission = rig.blocks.admit(b, 100)
    assert admission.cached_tokens == 8 + 12 and admission.by_tier == {"host": 20}  # blocks 0-1, then 3-5
    assert b.kv.filled == {3, 4, 5} and rig.blocks.computable(b) == BS  # up to the blocks after the hole
    rig.compute(b)  # the hole; advance then jumps over the loaded blocks
    assert b.num_computed == 24 and not b.kv.filled
    assert torch.equal(rig.keys(b, 24), want)
    rig.compute(b)  # the last token
    rig.blocks.release(b)
    rig.accounting()


def test_a_tier_read_that_comes_up_short_files_the_run_before_it_and_gives_the_rest_back(tmp_path):
    """A chain's blocks are taken before the read (it lands in them). A damaged block ends the run: the
    blocks before it are filed, those taken for the rest go back; the blocks after it are then read into the
    sequence's own blocks (after the hole), and only the damaged one is computed."""
    rig = Rig(num_blocks=16, disk=tmp_path)
    disk = rig.tiers.disk
    p = prompt(25, 9)  # six full matchable blocks
    a = rig.seq(p)
    rig.blocks.admit(a, 100)
    rig.compute(a)
    want = rig.keys(a, 24)
    rig.blocks.release(a)
    assert disk.writer.flush(10) and disk.num_blocks >= 6
    rig.cache.reset_prefix_cache()
    damaged = disk._path(rig.cache.hasher.hash_blocks(p[:24], b"")[2])
    data = bytearray(damaged.read_bytes())
    data[-30] ^= 1
    damaged.write_bytes(bytes(data))
    b = rig.seq(p)
    admission = rig.blocks.admit(b, 100)
    assert admission.cached_tokens == 8 + 12 and admission.by_tier == {"disk": 20}  # blocks 0-1, then 3-5
    assert rig.cache.match(p, b"", record_stats=False).num_tokens == 8  # the run before the damaged block
    assert b.kv.filled == {3, 4, 5} and disk.stats.corrupt == 1 and not damaged.exists()
    rig.accounting()
    rig.compute(b)  # the damaged block
    rig.compute(b)  # the last token
    assert torch.equal(rig.keys(b, 24), want)
    rig.blocks.release(b)
    rig.cache.reset_prefix_cache()
    assert rig.cache.stats().free_blocks == 16  # every block taken for the read came back
    rig.accounting()


def test_a_store_whose_fill_comes_up_short_files_only_what_it_filled():
    rig = Rig(num_blocks=8)
    tokens = prompt(16, 10)  # four blocks
    taken = []
    assert rig.blocks.store(tokens, lambda blocks: taken.extend(blocks) or 2, b"")
    assert rig.cache.match(tokens, b"", record_stats=False).block_ids == taken[:2]
    assert rig.cache.stats().cached_blocks == 2 and rig.cache.stats().free_blocks == 6
    assert not rig.blocks.store(prompt(8, 11), lambda blocks: 0, b"")  # nothing filled: nothing held
    assert rig.cache.stats().free_blocks == 6
    rig.accounting()


def test_chunks_are_filed_through_the_block_manager_and_an_identical_one_gives_its_blocks_back():
    rig = Rig(num_blocks=8)
    index = ChunkIndex(rig.blocks, BS, pad_token=1000, min_tokens=4)
    chunk = prompt(6, 7)  # two blocks, the second padded
    filled = []
    assert index.store(chunk, filled.extend)
    assert index.store(chunk, lambda blocks: None)  # filed meanwhile: the second copy goes back
    assert rig.cache.stats().cached_blocks == 2 and rig.cache.stats().in_use_blocks == 0
    assert index.lookup(chunk).block_ids == filled
    assert not index.store(prompt(40, 8), lambda blocks: None)  # ten blocks: no room, nothing held
    rig.accounting()


# ---- the property: free + evictable + in use == total after every operation --------------------------
OPS = st.lists(st.tuples(st.sampled_from(["admit", "advance", "finish", "evict"]),
                         st.integers(0, 10**6)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, host=st.booleans())
def test_block_accounting_holds_over_random_admit_advance_finish_evict(ops, host):
    """Random interleavings through the block manager (prompts sharing prefixes, partial blocks, host RAM
    below the pool or not). Hypothesis prints the failing sequence of operations and its reproduction blob."""
    rig = Rig(num_blocks=12, host=host)
    prompts = [prompt(n, n % 3) for n in (5, 9, 11, 14, 18)]  # three families of shared beginnings
    running: list[Sequence] = []
    for op, x in ops:
        if op == "admit":
            p = prompts[x % len(prompts)] + ([x % 7] if x % 2 else [])
            seq = rig.seq(p)
            if rig.blocks.admit(seq, 1 + x % 9) is not None:
                running.append(seq)
            else:
                assert not seq.block_table and seq.kv.node is None  # refused: nothing held
        elif op == "advance" and running:
            seq = running[x % len(running)]
            n = min(rig.blocks.computable(seq), 1 + x % 6)
            if n > 0 and rig.blocks.ensure_capacity(seq, seq.num_computed + n):
                rig.compute(seq, n)
        elif op == "finish" and running:
            rig.blocks.release(running.pop(x % len(running)))
        elif op == "evict":
            rig.cache.evict(1 + x % 4)
        rig.accounting()
        held = set()
        for seq in running:  # no block in two sequences' own sets
            assert not (seq.kv.owned & held)
            held |= seq.kv.owned
    for seq in running:
        rig.blocks.release(seq)
    rig.accounting()
    assert rig.cache.stats().in_use_blocks == 0
