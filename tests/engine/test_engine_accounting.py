"""Block accounting under pressure: preemption, aborts, sharing; checked after every scheduler step."""
from __future__ import annotations

import random

import pytest

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampling_params import SamplingParams
from tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=2)


def held_blocks(engine: LLMEngine) -> set[int]:
    """Blocks the running and waiting sequences hold outright (not through the tree)."""
    held: set[int] = set()
    for seq in engine.seqs.values():
        assert not (held & seq.kv.owned), "a block is owned by two sequences"
        held |= seq.kv.owned
    return held


def check(engine: LLMEngine) -> None:
    engine.cache.check_invariants()
    s = engine.cache.stats()
    assert s.free_blocks + s.evictable_blocks + s.in_use_blocks == s.total_blocks
    owned = held_blocks(engine)
    assert len(owned) <= s.in_use_blocks
    for seq in engine.seqs.values():
        assert len(set(seq.block_table)) == len(seq.block_table)
        if seq.status.value == "running":
            assert len(seq.block_table) * engine.config.block_size >= seq.num_computed


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_load_with_preemption_and_aborts(checkpoint, seed):
    rng = random.Random(seed)
    engine = build_engine(EngineConfig(model=str(checkpoint), block_size=4, num_gpu_blocks=24, max_num_seqs=6,
                                    max_num_batched_tokens=16))
    stems = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    finished, aborted, submitted = set(), set(), []
    for step in range(400):
        if len(submitted) < 30 and rng.random() < 0.4:
            rid = f"r{len(submitted)}"
            prompt = rng.choice(stems)[: rng.randrange(1, 20)] + [rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(1, 8))]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0.0, ignore_eos=True))
            submitted.append(rid)
        if engine.seqs and rng.random() < 0.08:
            rid = rng.choice(sorted(engine.seqs))
            out = engine.abort(rid)
            assert out.finished and out.finish_reason == "abort"
            aborted.add(rid)
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        check(engine)
        if len(submitted) == 30 and not engine.has_work():
            break
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        check(engine)
    assert finished | aborted == set(submitted)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the load"
    s = engine.cache.stats()
    assert s.in_use_blocks == 0
    assert s.free_blocks + s.evictable_blocks == s.total_blocks


def test_preempted_request_still_produces_the_same_text(checkpoint):
    prompts = [[3 + (i * 7 + j) % 50 for j in range(10)] for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(num_blocks):
        engine = build_engine(EngineConfig(model=str(checkpoint), block_size=4, num_gpu_blocks=num_blocks,
                                        max_num_seqs=5, max_num_batched_tokens=64, enable_prefix_cache=False))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        outs = {f"r{i}": [] for i in range(5)}
        while engine.has_work():
            for out in engine.step():
                outs[out.request_id].extend(out.new_token_ids)
        return outs, engine.scheduler.num_preemptions

    roomy, n0 = run(200)
    tight, n1 = run(16)
    assert n0 == 0 and n1 > 0
    assert roomy == tight
