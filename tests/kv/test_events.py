"""KV events in vLLM's format, read by a real ZMQ subscriber the way vllm-router and Dynamo read them: the
blocks a request cached are announced (tokens, block size, chain), an eviction removes them from the device
and announces them in host RAM, the replay socket gives back what a late subscriber missed, and blocks a
router could never match (blended KV) stay unannounced."""
from __future__ import annotations

import random

import pytest

from kv_event_readers import RouterView, decode_batch, dynamo_hash, read, replay, subscribe, vllm_router_hash
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.kv.events import announced, wire_hash
from reuse_server.kv.block_manager import approximate_namespace
from blend.chunk_index import ChunkIndex
from reuse_server.server.launcher import free_port
from tiny_checkpoint import write_tiny_checkpoint

BS = 4
SEED = 20261201


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(SEED + seed)
    print("prompt seed", SEED + seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def run(engine, rid, ids, max_tokens=1):
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       CacheOptions())
    while engine.has_work():
        engine.step()


@pytest.fixture
def engine(checkpoint):
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    engine = build_engine(EngineConfig(model=str(checkpoint), block_size=BS, num_gpu_blocks=40,
                                       blend_key_shift=False, cpu_cache_size=1 << 30, kv_events=pub,
                                       kv_events_replay=rep))
    yield engine
    engine.close()


def settled(engine, view):
    """Everything the engine queued so far is published and read."""
    events = engine.events
    return events._queue.empty() and view.batches and view.batches[-1][0] == events.published - 1


@pytest.mark.parametrize("local_hash", [vllm_router_hash, dynamo_hash], ids=["vllm-router", "dynamo"])
def test_cached_then_evicted_blocks_as_a_router_sees_them(engine, local_hash):
    sub = subscribe(engine.events.endpoint)
    try:
        read(sub, RouterView(BS), lambda: engine.events.subscribers == 1)  # the subscription has arrived
        view = RouterView(BS, local_hash)
        a = prompt(1)
        run(engine, "a", a)
        read(sub, view, lambda: settled(engine, view))
        full = len(a) // BS
        assert view.cached_blocks(a, "GPU") == full  # every full prompt block, chained from a root, by its tokens
        assert view.cached_blocks(prompt(2)) == 0
        # the hashes name the cache's own blocks: the ones a removal will name
        ours = engine.cache.hasher.hash_blocks(a, b"")
        assert {wire_hash(h) for h in ours} <= set(view.blocks["GPU"])

        for i in range(3):  # unrelated prompts that need the whole device pool
            run(engine, f"filler-{i}", prompt(100 + i))
        read(sub, view, lambda: settled(engine, view))
        assert view.cached_blocks(a, "GPU") == 0
        assert view.cached_blocks(a, "CPU") == full  # demoted to host RAM, announced there
        removed = {h for e in view.events if e["type"] == "BlockRemoved" and e["medium"] == "GPU"
                   for h in e["block_hashes"]}
        assert {wire_hash(h) for h in ours} <= removed
        # the events kept what the engine holds: every device block the router knows is in the tree
        assert len(view.blocks["GPU"]) == engine.cache.stats().cached_blocks - engine.cache._num_tails

        # pulled back from host RAM into the pool: announced on the device again
        run(engine, "a-again", a)
        read(sub, view, lambda: settled(engine, view))
        assert view.cached_blocks(a, "GPU") == full
    finally:
        sub.close()


def test_a_late_subscriber_gets_the_missed_batches_by_replay(engine):
    a = prompt(3)
    run(engine, "a", a)  # nobody is subscribed: the batches go only to the replay buffer
    sub = subscribe(engine.events.endpoint)
    try:
        read(sub, RouterView(BS), lambda: engine.events.subscribers == 1)
        missed = replay(engine.events.replay_endpoint, 0)
        assert [seq for seq, _ in missed] == list(range(engine.events.published))
        assert decode_batch(missed[0][1])[1][0]["type"] == "BlockStored"  # numbered from 0, from the first block
        view = RouterView(BS)
        for seq, payload in missed:
            view.apply(seq, payload)
        assert view.cached_blocks(a) == len(a) // BS
        # from a later start only the later batches
        assert [seq for seq, _ in replay(engine.events.replay_endpoint, 1)] == list(range(1, engine.events.published))
        # live events continue the sequence the replay ended at
        b = prompt(4)
        run(engine, "b", b)
        read(sub, view, lambda: settled(engine, view))
        assert view.cached_blocks(b) == len(b) // BS
    finally:
        sub.close()


def test_only_exact_prompt_kv_is_announced():
    assert announced(b"") and announced(b"tenant-digest")
    assert not announced(approximate_namespace(b"", "r=0.15"))
    assert not announced(ChunkIndex.chunk_namespace(b"", alone=True))
    assert not announced(ChunkIndex.chunk_namespace(b"tenant", alone=False))


def test_a_bad_endpoint_is_a_clear_error(checkpoint):
    with pytest.raises(ValueError, match="kv_events"):
        EngineConfig(model=str(checkpoint), kv_events="127.0.0.1:5557").validate()
    with pytest.raises(ValueError, match="kv_events_replay needs kv_events"):
        EngineConfig(model=str(checkpoint), kv_events_replay="tcp://127.0.0.1:5558").validate()
