"""The scheduler's loop without a model: a real Scheduler over a real BlockManager, RadixCache and (tiny)
KVPool, driven through schedule() and update() with tokens the test picks in place of a forward. After every
update the block accounting must hold (free + evictable + in use == total, the tree's own invariants), and
each sequence must be where the step left it: waiting, running with its KV advanced, or finished and
released."""
from __future__ import annotations

import pytest
from radix import RadixCache

from reuse_server.engine.detokenizer import IncrementalDetokenizer
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.engine.scheduler import Scheduler, StepOutput
from reuse_server.engine.sequence import SeqStatus, Sequence
from reuse_server.kv.block_manager import BlockManager
from reuse_server.kv.pool import KVPool
from tiny_checkpoint import build_tokenizer

BS = 4
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def make_scheduler(num_blocks: int, budget: int, max_seqs: int = 4, prefix_cache: bool = True) -> Scheduler:
    pool = KVPool(num_layers=1, num_blocks=num_blocks, block_size=BS, num_kv_heads=1, head_dim=2)
    cache = RadixCache(num_blocks, BS)
    blocks = BlockManager(cache, BS, prefix_cache, pool.copy_blocks, pool.clear_blocks)
    return Scheduler(blocks, max_seqs, budget, eos_ids={EOS}, max_sequence_tokens=num_blocks * BS)


def request(tokenizer, rid: str, prompt: list[int], max_tokens: int = 4, generates: bool = True,
            **params) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    seq = Sequence(rid, list(prompt), p, CacheOptions(), generates=generates)
    if generates:
        seq.detokenizer = IncrementalDetokenizer(tokenizer, p.stop, p.include_stop_str_in_output)
    return seq


def accounting(s: Scheduler):
    cache = s.blocks.cache
    cache.check_invariants()
    st = cache.stats()
    assert st.free_blocks + st.evictable_blocks + st.in_use_blocks == st.total_blocks
    owned = [b for seq in s.running for b in seq.kv.owned]
    assert len(owned) == len(set(owned)), "a block is owned by two sequences"
    assert len(owned) <= st.in_use_blocks
    for seq in s.waiting:
        assert not seq.kv.block_table and seq.kv.node is None, "a waiting sequence holds no block"
    for seq in s.running:
        assert len(seq.block_table) * BS >= seq.num_computed
    return st


def step(s: Scheduler, token_for=lambda seq: 3 + len(seq.output_ids)):
    """One step: schedule, 'compute' every slice, sample `token_for(seq)` where a sequence takes a token, update."""
    batch = s.schedule()
    tokens = {c.seq: token_for(c.seq) for c in batch if c.reaches_end and c.seq.generates}
    updates = s.update(StepOutput(batch, tokens))
    accounting(s)
    return batch, {u.seq.request_id: u for u in updates}


def test_a_prompt_is_computed_in_slices_then_decoded_then_finished_and_released(tokenizer):
    s = make_scheduler(num_blocks=32, budget=8)
    a = request(tokenizer, "a", range(10, 28), max_tokens=3)  # 18 prompt tokens
    s.add(a)
    assert a.status is SeqStatus.WAITING
    for computed in (8, 16):
        batch, updates = step(s)
        assert [(c.seq, c.num_tokens) for c in batch] == [(a, 8)]
        assert a.status is SeqStatus.RUNNING and a.num_computed == computed and not updates
        assert a.kv.num_published == computed // BS  # full blocks go to the tree as they are computed
        assert a.usage.cached_tokens == 0
    batch, updates = step(s)  # the prompt's last 2 tokens, and its first output token
    assert [c.num_tokens for c in batch] == [2]
    assert updates["a"].prompt_done and updates["a"].first_token and updates["a"].new_token_ids == [3]
    assert a.num_computed == 18 and a.output_ids == [3] and a.finish_reason is None
    _, updates = step(s)  # a decode token
    assert not updates["a"].prompt_done and a.output_ids == [3, 4]
    _, updates = step(s)
    assert a.output_ids == [3, 4, 5] and a.finish_reason == "length" and a.status is SeqStatus.FINISHED
    assert a not in s.running and not s.has_work()
    st = accounting(s)
    assert st.in_use_blocks == 0  # released: the computed full blocks stay cached, nothing else is held
    assert st.evictable_blocks == 20 // BS and st.free_blocks == 32 - 20 // BS


def test_the_budget_and_the_sequence_cap_bound_a_step_and_a_cached_prefix_is_not_recomputed(tokenizer):
    s = make_scheduler(num_blocks=64, budget=10, max_seqs=2)
    warm = request(tokenizer, "warm", range(40, 57), max_tokens=1)  # 17 tokens: 4 full matchable blocks
    s.add(warm)
    while s.has_work():
        step(s)
    hit = request(tokenizer, "hit", list(range(40, 56)) + [99, 98, 97], max_tokens=2)
    cold = [request(tokenizer, f"cold{i}", range(100 + 20 * i, 118 + 20 * i), max_tokens=2) for i in range(2)]
    for seq in cold + [hit]:
        s.add(seq)
    batch, _ = step(s)
    assert sum(c.num_tokens for c in batch) <= 10 and len(s.running) <= 2
    assert hit in s.running, "the request with the longest cached prefix goes first"
    assert hit.usage.cached_tokens == 16 and hit.num_computed == 19  # 16 matched + its 3 new tokens
    assert s.waiting[-1].status is SeqStatus.WAITING and len(s.waiting) == 1
    while s.has_work():
        batch, _ = step(s)
        assert sum(c.num_tokens for c in batch) <= 10 and len(s.running) <= 2
    assert all(seq.finish_reason == "length" and len(seq.output_ids) == 2 for seq in cold + [hit])
    assert accounting(s).in_use_blocks == 0


def test_running_out_of_blocks_preempts_the_newest_which_keeps_its_output_and_resumes(tokenizer):
    s = make_scheduler(num_blocks=8, budget=64, max_seqs=2, prefix_cache=False)
    a = request(tokenizer, "a", range(10, 22), max_tokens=12, ignore_eos=True)  # 12 + 12 tokens: 6 blocks
    b = request(tokenizer, "b", range(50, 62), max_tokens=12, ignore_eos=True)
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is b.status is SeqStatus.RUNNING and len(a.block_table) == len(b.block_table) == 3
    while not s.num_preemptions:
        step(s)
    assert b.status is SeqStatus.WAITING and b.queue.preemptions == 1 and list(s.waiting) == [b]
    assert b.output_ids and not b.block_table and b.num_computed == 0  # its output stays; its KV is gone
    assert a.status is SeqStatus.RUNNING
    st = accounting(s)
    assert st.in_use_blocks == len(a.block_table)  # only a holds blocks now
    while s.has_work():
        step(s)
    assert a.output_ids == list(range(3, 15)) and b.output_ids == list(range(3, 15))
    assert a.finish_reason == b.finish_reason == "length"
    st = accounting(s)
    assert st.in_use_blocks == 0 and st.free_blocks == 8


def test_stop_conditions_end_a_request_in_the_step_that_meets_them(tokenizer):
    s = make_scheduler(num_blocks=32, budget=64)
    eos = request(tokenizer, "eos", range(10, 15), max_tokens=10)
    ignored = request(tokenizer, "ignored", range(20, 25), max_tokens=3, ignore_eos=True)
    stop_id = request(tokenizer, "stop-id", range(30, 35), max_tokens=10, stop_token_ids=[7])
    text = tokenizer.encode("hello world", add_special_tokens=False)
    stop_str = request(tokenizer, "stop-str", range(40, 45), max_tokens=len(text), stop=["lo w"])
    for seq in (eos, ignored, stop_id, stop_str):
        s.add(seq)
    plan = {"eos": [5, EOS], "ignored": [EOS, EOS, EOS], "stop-id": [6, 7], "stop-str": text}
    texts = {rid: "" for rid in plan}
    while s.has_work():
        _, updates = step(s, lambda seq: plan[seq.request_id][len(seq.output_ids)])
        for rid, u in updates.items():
            texts[rid] += u.new_text
    assert (eos.finish_reason, eos.output_ids) == ("stop", [5, EOS])
    assert (ignored.finish_reason, ignored.output_ids) == ("length", [EOS, EOS, EOS])
    assert (stop_id.finish_reason, stop_id.output_ids) == ("stop", [6, 7])
    assert stop_str.finish_reason == "stop" and texts["stop-str"] == "hel"
    assert len(stop_str.output_ids) < len(text)  # it ended where the stop string appeared
    assert all(seq.status is SeqStatus.FINISHED for seq in (eos, ignored, stop_id, stop_str))
    assert accounting(s).in_use_blocks == 0


def test_abort_releases_a_running_and_a_waiting_request(tokenizer):
    s = make_scheduler(num_blocks=32, budget=8, max_seqs=1)
    running = request(tokenizer, "running", range(10, 30), max_tokens=5)
    waiting = request(tokenizer, "waiting", range(50, 60), max_tokens=5)
    s.add(running)
    s.add(waiting)
    step(s)
    assert running.status is SeqStatus.RUNNING and running.block_table and waiting.status is SeqStatus.WAITING
    assert accounting(s).in_use_blocks > 0
    for seq in (running, waiting):
        s.abort(seq)
        assert seq.finish_reason == "abort" and seq.status is SeqStatus.FINISHED and not seq.block_table
        accounting(s)
    assert not s.has_work() and accounting(s).in_use_blocks == 0


def test_a_request_waits_for_the_block_another_is_computing_then_hits_it(tokenizer):
    s = make_scheduler(num_blocks=32, budget=8)
    prompt = list(range(10, 30))
    first = request(tokenizer, "first", prompt, max_tokens=1)
    second = request(tokenizer, "second", prompt, max_tokens=1)
    s.add(first)
    s.add(second)
    batch, _ = step(s)
    assert [c.seq for c in batch] == [first] and second.status is SeqStatus.WAITING
    while second.status is SeqStatus.WAITING:
        step(s)
    assert second.usage.cached_tokens > 0  # it found first's published blocks instead of computing them
    while s.has_work():
        step(s)
    assert accounting(s).in_use_blocks == 0


def test_a_request_that_generates_nothing_ends_when_its_prompt_is_computed(tokenizer):
    s = make_scheduler(num_blocks=32, budget=8)
    pre = request(tokenizer, "pre", range(10, 22), generates=False)
    s.add(pre)
    _, updates = step(s)
    assert not updates and pre.status is SeqStatus.RUNNING
    batch, updates = step(s)  # the prompt's last 4 tokens: nothing is sampled, and it ends
    assert updates["pre"].prompt_done and updates["pre"].new_token_ids == [] and not pre.output_ids
    assert pre.finish_reason == "stop" and pre.status is SeqStatus.FINISHED
    st = accounting(s)
    assert st.in_use_blocks == 0 and st.evictable_blocks == 3  # its full blocks stay cached
