"""Engines over the tiny checkpoint with KV tiers, and greedy runs compared with a cold one: shared by the tier
tests (a helper module at the tests' root, like engine_runs)."""
from __future__ import annotations

import random

import pytest

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

BS = 4


def make(checkpoint, **kw):
    """An engine over checkpoint with a 40-block pool; kw are EngineConfig fields (the tiers among them)."""
    config = dict(model=str(checkpoint), block_size=BS, num_gpu_blocks=40, blend_key_shift=False)
    config.update(kw)
    return build_engine(EngineConfig(**config))


def run(engine, rid, ids, max_tokens=6, **cache):
    """Greedy tokens, their logprobs and the last output of one request run to its end (every max_tokens of
    it: a tier fault may cost hits, never the answer); the radix cache's invariants hold after every step."""
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True),
                       CacheOptions(**cache))
    tokens, logprobs, last = [], [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.logprobs or []]
                last = out
        engine.cache.check_invariants()
    assert last is not None and last.finish_reason == "length"
    return tokens, logprobs, last


def random_prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    print("prompt seed", seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def same_answer(got, cold):
    assert got[0] == cold[0]
    assert got[1] == pytest.approx(cold[1], abs=1e-4)
