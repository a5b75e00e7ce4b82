"""Cache-aware admission: the longest cached prefix goes first, and nobody waits forever."""
from __future__ import annotations

import pytest

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.engine.scheduler import MAX_SKIPS
from tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def finish_all(engine):
    while engine.has_work():
        engine.step()


def test_longest_cached_prefix_is_admitted_first(checkpoint):
    engine = build_engine(EngineConfig(model=str(checkpoint), block_size=4, num_gpu_blocks=128, max_num_seqs=1,
                                    max_num_batched_tokens=256))
    shared = list(range(3, 35))
    engine.add_request("warm", shared + [40], SamplingParams(max_tokens=1))
    finish_all(engine)
    p = SamplingParams(max_tokens=1)
    engine.add_request("cold-1", list(range(100, 130)), p)
    engine.add_request("cold-2", list(range(130, 160)), p)
    engine.add_request("hit", shared + [41, 42], p)
    first = [out.request_id for out in engine.step()]  # one sequence at a time: who went first?
    assert first == ["hit"]
    finish_all(engine)


def test_passed_over_requests_are_not_starved(checkpoint):
    engine = build_engine(EngineConfig(model=str(checkpoint), block_size=4, num_gpu_blocks=128, max_num_seqs=1,
                                    max_num_batched_tokens=256))
    shared = list(range(3, 35))
    engine.add_request("warm", shared + [40], SamplingParams(max_tokens=1))
    finish_all(engine)
    engine.add_request("cold", list(range(100, 130)), SamplingParams(max_tokens=1))
    order = []
    for i in range(3 * MAX_SKIPS):  # a steady stream of cache-friendly requests keeps arriving
        engine.add_request(f"hit{i}", shared + [50 + i], SamplingParams(max_tokens=1))
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    finish_all(engine)
    assert "cold" in order, "the cold request never ran while cache hits kept arriving"
    assert order.index("cold") <= MAX_SKIPS + 1
