"""Prompt-cache pins through the scheduler's loop without a model (the rig of test_scheduler_unit): a real
Scheduler, BlockManager, RadixCache and KVPool, a clock the test passes in (no sleeping). A breakpoint's prefix
survives a flood that evicts everything unpinned, a hit renews it, it is ordinary cache once its time is up,
and a tenant past --max-pinned-share loses its least recently used pin, never a request."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radix import RadixCache

from reuse_server.engine.detokenizer import IncrementalDetokenizer
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.kv.pins import CacheBreakpoint
from reuse_server.engine.scheduler import Scheduler, StepOutput
from reuse_server.engine.sequence import Sequence
from reuse_server.kv.block_manager import BlockManager
from reuse_server.kv.pins import breakpoint_writes
from reuse_server.kv.pool import KVPool
from tiny_checkpoint import build_tokenizer

BS = 4
SEED = 4343
FIVE_MINUTES, ONE_HOUR = 300.0, 3600.0
TOKENIZER = build_tokenizer()


def make_scheduler(num_blocks: int, share: float = 0.5, max_seqs: int = 4) -> Scheduler:
    pool = KVPool(num_layers=1, num_blocks=num_blocks, block_size=BS, num_kv_heads=1, head_dim=2)
    cache = RadixCache(num_blocks, BS)
    blocks = BlockManager(cache, BS, True, pool.copy_blocks, pool.clear_blocks, max_pinned_share=share)
    return Scheduler(blocks, max_seqs, 64, eos_ids=set(), max_sequence_tokens=num_blocks * BS)


def run(s: Scheduler, seq: Sequence, now: float) -> Sequence:
    """Serve seq to its end at time `now` (one token of output: each step samples token 1)."""
    s.add(seq)
    for _ in range(100):
        if not s.has_work():
            return seq
        batch = s.schedule(now)
        s.update(StepOutput(batch, {c.seq: 1 for c in batch if c.reaches_end}))
        s.blocks.cache.check_invariants()
    raise AssertionError(f"{seq.request_id} is still waiting after 100 steps")


def request(rid: str, prompt: list[int], *breakpoints: CacheBreakpoint, tenant: str | None = None) -> Sequence:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seq = Sequence(rid, list(prompt), params, CacheOptions(tenant=tenant, breakpoints=list(breakpoints)))
    seq.detokenizer = IncrementalDetokenizer(TOKENIZER, params.stop, params.include_stop_str_in_output)
    return seq


def tokens(n: int, salt: int) -> list[int]:
    rng = random.Random(SEED * 1000 + salt)
    return [rng.randrange(3, 500) for _ in range(n)]


def cached_now(s: Scheduler, prompt: list[int], tenant: str | None = None) -> int:
    return s.blocks.cache.match(prompt, CacheOptions(tenant=tenant).namespace, record_stats=False).num_tokens


def test_a_pinned_prefix_survives_a_flood_is_renewed_by_a_hit_and_is_ordinary_cache_after_its_ttl():
    s = make_scheduler(num_blocks=24)
    system = tokens(16, 0)  # 4 blocks, marked
    first = run(s, request("first", system + tokens(6, 1), CacheBreakpoint(16, FIVE_MINUTES)), now=0.0)
    assert first.usage.breakpoint_write_tokens == {300: 16} and first.usage.cache_write_tokens == 20
    assert s.blocks.cache.stats().pinned_blocks == 4
    for i in range(12):  # every other prompt fills the pool and evicts all that is not pinned
        run(s, request(f"flood{i}", tokens(40, 100 + i)), now=10.0 + i)
    assert s.blocks.cache.stats().evicted_blocks > 20
    assert cached_now(s, system) == 16, "the pinned prefix was evicted"
    assert cached_now(s, first.prompt_ids) == 16  # the unpinned rest of the first prompt is gone

    hit = run(s, request("hit", system + tokens(5, 2)), now=200.0)  # reads the pin: it lives to 500 now
    assert hit.usage.cached_tokens == 16 and hit.usage.breakpoint_write_tokens == {}
    s.schedule(450.0)  # past the first expiry (300), before the renewed one
    assert s.blocks.cache.stats().pinned_blocks == 4
    s.schedule(500.0)
    assert s.blocks.cache.stats().pinned_blocks == 0 and len(s.blocks.pins) == 0
    assert cached_now(s, system) == 16  # ordinary cache now: still there until something needs the room
    run(s, request("after", tokens(88, 3)), now=501.0)  # 22 of 24 blocks
    assert cached_now(s, system) < 16, "an expired pin still kept its prefix"
    assert s.blocks.cache.stats().in_use_blocks == 0


def test_a_breakpoint_inside_a_block_is_read_to_the_token_after_a_flood():
    """Anthropic reads a hit up to the breakpoint; the pool keeps whole blocks, so the block the breakpoint
    falls in is pinned too and a hit copies its leading tokens (Claude Code's breakpoints fall anywhere)."""
    s = make_scheduler(num_blocks=24)
    system = tokens(18, 50)  # 4 blocks and 2 tokens, marked at its end
    first = run(s, request("first", system + tokens(6, 51), CacheBreakpoint(18, FIVE_MINUTES)), now=0.0)
    assert first.usage.breakpoint_write_tokens == {300: 18}
    assert s.blocks.cache.stats().pinned_blocks == 5
    for i in range(12):
        run(s, request(f"flood{i}", tokens(40, 150 + i)), now=10.0 + i)
    assert s.blocks.cache.stats().evicted_blocks > 20 and s.blocks.cache.stats().pinned_blocks == 5
    hit = run(s, request("hit", system + tokens(5, 52)), now=200.0)
    assert hit.usage.cached_tokens == 18, "the pinned prefix was not read up to its breakpoint"
    assert [p.expires_at for p in s.blocks.pins] == [500.0], "a hit up to the breakpoint did not renew its pin"
    s.schedule(500.0)
    assert s.blocks.cache.stats().pinned_blocks == 0 and len(s.blocks.pins) == 0


def test_a_breakpoint_later_in_the_block_a_pin_stops_before_holds_that_block_too():
    s = make_scheduler(num_blocks=24)
    system = tokens(18, 60)
    run(s, request("aligned", system + [1], CacheBreakpoint(16, FIVE_MINUTES)), now=0.0)
    assert s.blocks.cache.stats().pinned_blocks == 4
    run(s, request("inside", system + [2, 3, 4], CacheBreakpoint(18, ONE_HOUR)), now=1.0)  # the block is full
    assert s.blocks.cache.stats().pinned_blocks == 5 and len(s.blocks.pins) == 1
    assert [(p.ttl, p.expires_at) for p in s.blocks.pins] == [(ONE_HOUR, 1.0 + ONE_HOUR)]
    for i in range(12):
        run(s, request(f"flood{i}", tokens(40, 160 + i)), now=10.0 + i)
    assert run(s, request("hit", system + [3]), now=20.0).usage.cached_tokens == 18


def test_a_tenant_past_its_share_loses_its_least_recently_used_pin_and_others_keep_theirs():
    s = make_scheduler(num_blocks=32, share=0.25)  # 8 blocks a tenant
    a, b, c = tokens(16, 10), tokens(16, 11), tokens(16, 12)
    run(s, request("a", a + [1, 2], CacheBreakpoint(16, ONE_HOUR), tenant="t1"), now=0.0)
    run(s, request("other", c + [1], CacheBreakpoint(16, ONE_HOUR), tenant="t2"), now=1.0)
    run(s, request("b", b + [1, 2], CacheBreakpoint(16, ONE_HOUR), tenant="t1"), now=2.0)
    assert s.blocks.cache.stats().pinned_blocks == 12
    run(s, request("a-again", a + [5], tenant="t1"), now=3.0)  # a is now the more recently used of t1's pins
    third = run(s, request("third", tokens(16, 13) + [1], CacheBreakpoint(16, ONE_HOUR), tenant="t1"), now=4.0)
    assert third.finish_reason == "length"  # the request itself never fails
    assert s.blocks.pins_given_way == 1
    assert s.blocks.pins.blocks_of("t1") == 8 and s.blocks.pins.blocks_of("t2") == 4
    for i in range(3):  # what is not pinned goes (16 blocks each: 20 are not pinned)
        run(s, request(f"flood{i}", tokens(60, 14 + i)), now=5.0 + i)
    assert s.blocks.pins_given_way == 1
    assert cached_now(s, a, "t1") == 16 and cached_now(s, c, "t2") == 16
    assert cached_now(s, b, "t1") == 0, "the least recently used pin did not give way"


def test_a_pool_that_cannot_admit_anyone_makes_pins_give_way():
    s = make_scheduler(num_blocks=16, share=1.0)
    run(s, request("pin", tokens(48, 20) + [1], CacheBreakpoint(48, ONE_HOUR)), now=0.0)
    assert s.blocks.cache.stats().pinned_blocks == 12
    big = run(s, request("big", tokens(40, 21)), now=1.0)  # needs 11 blocks: only 4 are not pinned
    assert big.finish_reason == "length" and s.blocks.pins_given_way == 1 and len(s.blocks.pins) == 0


def test_breakpoint_writes_split_by_ttl_and_start_after_what_was_read():
    bps = [CacheBreakpoint(100, ONE_HOUR), CacheBreakpoint(40, ONE_HOUR), CacheBreakpoint(160, FIVE_MINUTES)]
    assert breakpoint_writes(bps, 200, 0) == {3600: 100, 300: 60}
    assert breakpoint_writes(bps, 200, 64) == {3600: 36, 300: 60}
    assert breakpoint_writes(bps, 200, 160) == {}
    assert breakpoint_writes(bps, 120, 0) == {3600: 100, 300: 20}  # a breakpoint past the prompt ends with it


OPS = st.lists(st.tuples(st.sampled_from(["serve", "serve_marked", "tick", "evict"]), st.integers(0, 10**6)),
               min_size=1, max_size=30)


@settings(max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_pins_never_leak_and_the_accounting_holds(ops):
    """Random requests (some marked, two tenants, shared beginnings), clock ticks and evictions. After each:
    the tree's invariants, pinned blocks == the blocks under the pin table's pins, each tenant within its
    budget, every pin unexpired; at the end, once every pin's time is up, nothing is pinned or in use.
    Hypothesis prints the failing operations and their reproduction blob."""
    s = make_scheduler(num_blocks=20, share=0.3)
    now, n = 0.0, 0
    families = [tokens(12, 30 + k) for k in range(3)]
    for op, x in ops:
        if op in ("serve", "serve_marked"):
            n += 1
            prompt = families[x % 3][: 4 + x % 9] + tokens(1 + x % 10, 40 + n)
            marks = [CacheBreakpoint(1 + x % len(prompt), (FIVE_MINUTES, ONE_HOUR)[x % 2])] if op == "serve_marked" else []
            if x % 5 == 0 and marks:
                marks.append(CacheBreakpoint(len(prompt), FIVE_MINUTES))
            seq = run(s, request(f"r{n}", prompt, *marks, tenant=("t1", "t2")[x % 2]), now)
            assert seq.finish_reason == "length"
            assert sum(seq.usage.breakpoint_write_tokens.values()) <= max(b.offset for b in marks) if marks else \
                seq.usage.breakpoint_write_tokens == {}
        elif op == "tick":
            now += (1.0, 100.0, 400.0, 4000.0)[x % 4]
            s.schedule(now)
        else:
            s.blocks.cache.evict(1 + x % 8)
        cache = s.blocks.cache
        cache.check_invariants()
        stats = cache.stats()
        assert stats.free_blocks + stats.evictable_blocks + stats.in_use_blocks == stats.total_blocks
        pins = list(s.blocks.pins)
        assert stats.pinned_blocks == s.blocks.pins.blocks_of("t1") + s.blocks.pins.blocks_of("t2")
        assert stats.in_use_blocks == stats.pinned_blocks  # nothing runs between operations: only pins hold
        for tenant in ("t1", "t2"):
            assert s.blocks.pins.blocks_of(tenant) <= s.blocks.pin_budget
        assert all(p.expires_at > now for p in pins) or op != "tick"
        assert all(p.node.attached for p in pins)
    s.schedule(now + 10 * ONE_HOUR)
    stats = s.blocks.cache.stats()
    assert len(s.blocks.pins) == 0 and stats.pinned_blocks == 0 and stats.in_use_blocks == 0


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
