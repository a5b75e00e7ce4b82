"""Prefix reuse must change nothing but the work done: same logits, same greedy text, honest cached_tokens."""
from __future__ import annotations

import random

import pytest

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from engine_runs import assert_logprobs_close, run_one_by_one, run_to_end, shared_prefix_prompts
from tiny_checkpoint import write_tiny_checkpoint

BS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=1)


def make_engine(path, prefix=True, **kw) -> LLMEngine:
    cfg = dict(model=str(path), block_size=BS, num_gpu_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
               enable_prefix_cache=prefix)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_on_and_off_agree(checkpoint, seed):
    rng = random.Random(seed)
    on = make_engine(checkpoint, prefix=True)
    off = make_engine(checkpoint, prefix=False)
    prompts = shared_prefix_prompts(rng, on.vocab_size, 6)
    got_on = run_one_by_one(on, prompts)
    got_off = run_one_by_one(off, prompts)
    hits = 0
    for rid, _ in prompts:
        ids_on, lp_on, out_on = got_on[rid]
        ids_off, lp_off, out_off = got_off[rid]
        assert ids_on == ids_off
        assert_logprobs_close(lp_on, lp_off)
        assert out_off.cached_tokens == 0
        hits += out_on.cached_tokens
    assert on.snapshot()["prefix_hit_tokens"] == hits
    assert off.snapshot()["in_use_blocks"] == on.snapshot()["in_use_blocks"] == 0


def test_second_request_reports_every_shared_token(checkpoint):
    engine = make_engine(checkpoint)
    rng = random.Random(7)
    shared = [rng.randrange(3, engine.vocab_size) for _ in range(23)]  # 5 full blocks + 3 tokens
    first = shared + [5, 6, 7]
    second = shared + [9, 9]
    a = run_one_by_one(engine, [("a", first), ("b", second)])
    assert a["a"][2].cached_tokens == 0
    # 5 full blocks match; the sixth differs in its last token, so its first 3 tokens' KV is copied.
    assert a["b"][2].cached_tokens == 23
    assert engine.snapshot()["in_use_blocks"] == 0
    plain = make_engine(checkpoint, prefix=False)
    b = run_one_by_one(plain, [("b", second)])
    assert a["b"][0] == b["b"][0]
    assert_logprobs_close(a["b"][1], b["b"][1])


def test_a_follow_up_reuses_the_previous_requests_partial_last_block(checkpoint):
    """The previous request's computed tokens past its last full block are kept as a tail: a prompt that
    continues them recomputes nothing it shares, to the token."""
    engine = make_engine(checkpoint)
    rng = random.Random(8)
    first = [rng.randrange(3, engine.vocab_size) for _ in range(14)]
    a = run_one_by_one(engine, [("a", first)], max_tokens=4)
    answer = a["a"][0]
    computed = len(first) + len(answer) - 1  # the last sampled token was never fed back
    assert computed % BS  # the run ends inside a block (17 tokens: 4 full blocks + 1)
    follow = first + answer + [5, 6]
    b = run_one_by_one(engine, [("b", follow)], max_tokens=4)
    assert b["b"][2].cached_tokens == computed
    plain = make_engine(checkpoint, prefix=False)
    c = run_one_by_one(plain, [("b", follow)], max_tokens=4)
    assert b["b"][0] == c["b"][0]
    assert_logprobs_close(b["b"][1], c["b"][1])
    assert engine.snapshot()["in_use_blocks"] == 0


def test_fully_cached_prompt_still_computes_its_last_token(checkpoint):
    engine = make_engine(checkpoint)
    prompt = list(range(3, 3 + 4 * BS))  # exactly 4 blocks
    first = run_one_by_one(engine, [("a", prompt)])
    second = run_one_by_one(engine, [("b", prompt)])
    assert first["a"][0] == second["b"][0]
    # only the last token is computed, for its logits: the fourth block's first 3 tokens are copied
    assert second["b"][2].cached_tokens == 4 * BS - 1


def test_chunked_prefill_gives_the_same_tokens(checkpoint):
    rng = random.Random(3)
    big = make_engine(checkpoint, prefix=False, max_num_batched_tokens=512)
    small = make_engine(checkpoint, prefix=False, max_num_batched_tokens=5)
    prompts = [(f"r{i}", [rng.randrange(3, big.vocab_size) for _ in range(rng.randrange(10, 40))]) for i in range(4)]
    a = run_to_end(big, prompts)
    b = run_to_end(small, prompts)
    for rid, _ in prompts:
        assert a[rid][0] == b[rid][0]
        assert_logprobs_close(a[rid][1], b[rid][1])


def test_salted_requests_do_not_share(checkpoint):
    engine = make_engine(checkpoint)
    prompt = list(range(3, 3 + 5 * BS))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    seen = {}
    for rid, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")]:
        engine.add_request(rid, prompt, params, CacheOptions(cache_salt=salt))
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    seen[rid] = out.cached_tokens
    assert seen == {"a": 0, "b": 0, "c": 5 * BS - 1}


def test_per_request_opt_out_neither_reads_nor_writes(checkpoint):
    engine = make_engine(checkpoint)
    prompt = list(range(3, 3 + 5 * BS))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    seen = {}
    for rid, use in [("a", False), ("b", True), ("c", False), ("d", True)]:
        engine.add_request(rid, prompt, params, CacheOptions(prefix_cache=use))
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    seen[rid] = out.cached_tokens
    assert seen == {"a": 0, "b": 0, "c": 0, "d": 5 * BS - 1}


def test_a_prompt_sharing_only_part_of_the_first_block_is_computed_whole(checkpoint):
    """Partial-block copies start after at least one matched full block: a few shared leading (template)
    tokens are not worth giving up the causal prefill kernel for a masked one."""
    engine = make_engine(checkpoint)
    rng = random.Random(9)
    first = [rng.randrange(3, engine.vocab_size) for _ in range(20)]
    second = first[:3] + [rng.randrange(3, engine.vocab_size) for _ in range(17)]
    out = run_one_by_one(engine, [("a", first), ("b", second)])
    assert out["b"][2].cached_tokens == 0


def computed_tokens(engine: LLMEngine, requests, after_each_step=None) -> tuple[dict, int]:
    """run_to_end, also counting the prompt tokens the model computed (every scheduled chunk's tokens)."""
    total = [0]
    real = engine.runner.run

    def counting(chunks, want, *rest):
        total[0] += sum(c.num_tokens for c in chunks)
        return real(chunks, want, *rest)

    engine.runner.run = counting
    results = run_to_end(engine, requests, after_each_step=after_each_step)
    decode = sum(len(ids) - 1 for ids, _, _ in results.values())  # each generated token but the last is fed back
    return results, total[0] - decode


def test_a_burst_sharing_an_uncached_prefix_computes_it_once(checkpoint):
    """Four requests with one 48-token system prompt arrive together into an empty cache: with a budget that
    fits them all in one step, they would all compute the prompt. The first computes it; the others wait one
    step and hit it, and their text is what each gets alone without any cache."""
    rng = random.Random(11)
    stem = [rng.randrange(3, 200) for _ in range(48)]  # 12 full blocks
    burst = [(f"r{i}", stem + [rng.randrange(3, 200) for _ in range(5)]) for i in range(4)]

    deduped = make_engine(checkpoint, max_num_batched_tokens=1024)
    got, computed = computed_tokens(deduped, burst, after_each_step=lambda e: e.cache.check_invariants())
    assert computed == 48 + 4 * 5  # the stem once, every tail
    assert sorted(out.cached_tokens for _, _, out in got.values()) == [0, 48, 48, 48]

    both = make_engine(checkpoint, max_num_batched_tokens=1024, dedup_prefill=False)
    _, computed_twice = computed_tokens(both, burst)
    assert computed_twice == 4 * 53  # the baseline: everyone computes the stem in the same step

    alone = run_one_by_one(make_engine(checkpoint, prefix=False), burst)
    for rid, _ in burst:
        assert got[rid][0] == alone[rid][0]
        assert_logprobs_close(got[rid][1], alone[rid][1])
    assert deduped.snapshot()["in_use_blocks"] == 0


def test_a_request_waits_only_for_the_blocks_it_shares(checkpoint):
    """The second request shares 2 of the first's 6 full blocks, then diverges: although the step has budget
    for both, it waits while the first computes them, then computes everything after them itself."""
    rng = random.Random(12)
    shared = [rng.randrange(3, 200) for _ in range(8)]
    first = shared + [rng.randrange(3, 200) for _ in range(17)]
    second = shared + [rng.randrange(3, 200) for _ in range(9)]
    engine = make_engine(checkpoint, max_num_batched_tokens=40)
    got, computed = computed_tokens(engine, [("first", first), ("second", second)])
    assert got["second"][2].cached_tokens == 8
    assert computed == len(first) + len(second) - 8


def test_a_request_waits_with_budget_left_only_while_its_block_is_being_computed(checkpoint):
    """Step by step: the follower shares the leader's whole 40-token stem. It is held back while the leader
    computes the stem's last chunk although the step has budget for it, and admitted the step after, when it
    hits all 40 tokens."""
    stem = list(range(3, 3 + 40))
    engine = make_engine(checkpoint, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("leader", stem + [60], params)
    engine.step()  # the leader's first 32 tokens: the whole budget
    engine.add_request("follower", stem + [61], params)
    engine.step()  # the leader's last 9 tokens; 23 tokens of budget are left
    assert [s.request_id for s in engine.scheduler.running] == ["leader"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["follower"]
    finished = {}
    while engine.has_work():
        for out in engine.step():
            finished[out.request_id] = out
    assert finished["follower"].cached_tokens == 40
    assert engine.snapshot()["in_use_blocks"] == 0


def test_admission_is_reported_once_before_the_prompt_is_computed_with_its_prefix_match(checkpoint):
    """Streams that answer before the first token (Anthropic's message_start) read the engine's Admission: it
    comes on the step that admits a request, steps before a chunked prefill's first output, once, with the
    cached tokens the last output reports; a precompute samples nothing and is not reported."""
    engine = make_engine(checkpoint, max_num_batched_tokens=8)  # 20 uncached tokens take 3 steps
    admissions = []
    engine.on_admitted = admissions.append
    rng = random.Random(11)
    shared = [rng.randrange(3, engine.vocab_size) for _ in range(22)]
    run_to_end(engine, [("warm", shared + [5, 6])])
    admissions.clear()
    engine.precompute("chunks", shared + [7], CacheOptions(chunk_spans=[(0, 23)]))
    engine.add_request("r", shared + [rng.randrange(3, engine.vocab_size) for _ in range(20)],
                       SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    admitted_at = first_output_at = last = None
    step = 0
    while engine.has_work():
        step += 1
        for out in engine.step():
            if out.request_id == "r":
                first_output_at, last = first_output_at or step, out
        if admissions and admitted_at is None:
            admitted_at = step
    assert [a.request_id for a in admissions] == ["r"]
    (admission,) = admissions
    assert admitted_at < first_output_at
    assert admission.cached_tokens == last.cached_tokens == 22 and admission.num_prompt_tokens == 42
