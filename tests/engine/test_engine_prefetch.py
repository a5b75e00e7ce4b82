"""LLMEngine.prefetch: an admission that computes nothing, answered at once, or parked until the pool can take
it (every block held by a running request) and answered from a later step."""
from __future__ import annotations

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

BS = 4


def balanced(engine) -> None:
    engine.cache.check_invariants()
    s = engine.cache.stats()
    assert s.free_blocks + s.evictable_blocks + s.in_use_blocks == s.total_blocks


def test_a_prefetch_the_pool_cannot_take_waits_for_blocks_and_then_reports_what_is_resident(tiny_llama_path):
    engine = build_engine(EngineConfig(model=str(tiny_llama_path), block_size=BS, num_gpu_blocks=12, max_num_seqs=1,
                                       max_num_batched_tokens=64, blend_key_shift=False))
    shared, tail = list(range(10, 26)), [40, 41, 42, 43]
    engine.add_request("long", shared + tail, SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True))
    while engine.cache.stats().free_blocks + engine.cache.stats().evictable_blocks:
        engine.step()  # until the running request holds every block of the pool
        balanced(engine)
    assert "long" in engine.seqs
    # 16 tokens match in the tree; the next block shares 2 tokens with "long"'s, whose copy needs a free block
    ids = shared + tail[:2] + [90, 91]
    assert engine.prefetch("early", ids, CacheOptions()) is None
    assert engine.has_work() and "early" in engine.seqs
    outs = {}
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id] = out
        balanced(engine)
    fetched = outs["early"]
    assert fetched.finished and fetched.finish_reason == "stop" and not fetched.new_token_ids
    assert fetched.cached_tokens == 16 + 2
    assert outs["long"].finish_reason == "length" and "early" not in engine.seqs
    assert engine.cache.stats().in_use_blocks == 0
    again = engine.prefetch("now", ids, CacheOptions())  # a pool with room answers at once
    assert again.finished and again.cached_tokens >= 16 and "now" not in engine.seqs
    assert engine.cache.stats().in_use_blocks == 0


def test_an_aborted_parked_prefetch_is_gone(tiny_llama_path):
    engine = build_engine(EngineConfig(model=str(tiny_llama_path), block_size=BS, num_gpu_blocks=12, max_num_seqs=1,
                                       max_num_batched_tokens=64, blend_key_shift=False))
    shared, tail = list(range(10, 26)), [40, 41, 42, 43]
    engine.add_request("long", shared + tail, SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True))
    while engine.cache.stats().free_blocks + engine.cache.stats().evictable_blocks:
        engine.step()
    assert engine.prefetch("early", shared + tail[:2] + [90, 91], CacheOptions()) is None
    out = engine.abort("early")
    assert out.finished and out.finish_reason == "abort" and "early" not in engine.seqs
    while engine.has_work():
        assert all(o.request_id != "early" for o in engine.step())
        balanced(engine)
    assert engine.cache.stats().in_use_blocks == 0
