"""Redis losing our blocks (a real redis-server): restarted empty, FLUSHALL, a block evicted from the middle
of a chain, and Redis at maxmemory with allkeys-lru evicting as it likes. Each loss is a miss that costs a
recompute, never an error or a different answer (every answer is compared with a cold run); the blocks are
written again when they are computed again, so the hit rate recovers; and where only an unbroken chain is any
use, blocks after an evicted parent are not transferred."""
from __future__ import annotations

import pytest

from redis_server import redis_server
from reuse_server.engine.sampling_params import CacheOptions
from tier_runs import BS, make, random_prompt, run, same_answer
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a redis-server

SEED = 20261201
EVICTED = 2  # the block deleted from the middle of a chain, as an LRU eviction would


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def prompt(seed: int, n: int = 70) -> list[int]:
    return random_prompt(SEED + seed, n)


def redis_tokens(got) -> int:
    return got[2].tier_tokens.get("redis", 0)


def full(ids) -> int:
    return (len(ids) - 1) // BS * BS


@pytest.fixture(scope="module")
def cold(checkpoint):
    engine = make(checkpoint, enable_prefix_cache=False)
    return lambda ids: run(engine, f"cold-{len(ids)}-{ids[0]}-{ids[-1]}", ids)


def evict_the_device(engine, seed: int) -> None:
    """Unrelated prompts that need the whole device pool."""
    for i in range(3):
        run(engine, f"filler-{seed}-{i}", prompt(1000 + 10 * seed + i), max_tokens=1)


def settle(*engines) -> None:
    for engine in engines:
        assert engine.tiers.remote.writer.flush(10)


@pytest.mark.parametrize("loss", ["restart", "flushall", "evicted"])
def test_blocks_lost_from_redis_are_recomputed_written_again_and_hit_again(checkpoint, cold, loss):
    ids = prompt(1)
    with redis_server() as server:
        writer = make(checkpoint, redis_url=server.url)
        run(writer, "write", ids)
        settle(writer)
        blob_bytes = server.client().strlen(chain_keys(writer, ids)[0])  # the same for every block
        reader = make(checkpoint, redis_url=server.url)
        assert redis_tokens(run(reader, "read", ids)) == full(ids)  # the reader now knows them as stored
        evict_the_device(reader, 1)
        settle(reader)
        if loss == "restart":
            server.kill()
            server.start()  # empty, on the same port
        elif loss == "flushall":
            server.client().flushall()
        else:
            evicted_key = chain_keys(reader, ids)[EVICTED]
            assert server.client().delete(evicted_key) == 1
        stats = reader.tiers.remote.stats
        read_before = stats.read_bytes

        again = run(reader, "again", ids)  # a miss, where it used to hit: recomputed, the same answer
        same_answer(again, cold(ids))
        # the evicted block alone is recomputed (the blocks after it are loaded around the hole); after a
        # restart or a flush, everything
        assert redis_tokens(again) == (full(ids) - BS if loss == "evicted" else 0)
        # no block was read that was not used: the pull of the chain stopped at the gap, in Redis
        assert stats.read_bytes - read_before == redis_tokens(again) // BS * blob_bytes
        assert stats.errors == 0 or loss == "restart"  # (the restart may break a connection once)
        settle(reader)

        fresh = make(checkpoint, redis_url=server.url)  # the recomputed blocks were written again
        recovered = run(fresh, "fresh", ids)
        assert redis_tokens(recovered) == full(ids)
        same_answer(recovered, cold(ids))
        for engine in (writer, reader, fresh):
            engine.close()


def chain_keys(engine, ids) -> list[bytes]:
    """The Redis keys of the prompt's full blocks, in chain order."""
    hashes = engine.cache.hasher.hash_blocks(ids[:full(ids)], CacheOptions().namespace)
    return [engine.tiers.remote.key(h) for h in hashes]


def limit_memory(client, room_bytes: int, policy: str) -> None:
    """Redis may hold `room_bytes` more than it holds now; past that, `policy` decides (CONFIG SET, as an
    operator would). No room: a limit of 1 byte, as Redis reads 0 as none and what it holds now shrinks when
    it frees client buffers, which would make room for a block."""
    client.config_set("maxmemory-policy", policy)
    client.config_set("maxmemory", client.info("memory")["used_memory"] + room_bytes if room_bytes else 1)


def test_redis_evicting_our_blocks_at_maxmemory_costs_recomputes_never_answers(checkpoint, cold):
    prompts = [prompt(10 + i) for i in range(8)]
    with redis_server() as server:
        client = server.client()
        writer = make(checkpoint, redis_url=server.url)
        run(writer, "first", prompts[0])
        settle(writer)
        blob_bytes = client.strlen(chain_keys(writer, prompts[0])[0])
        limit_memory(client, 4 * len(chain_keys(writer, prompts[0])) * blob_bytes, "allkeys-lru")  # a few prompts
        for i, ids in enumerate(prompts[1:]):
            run(writer, f"write-{i}", ids)
            settle(writer)
        assert client.info("stats")["evicted_keys"] > 0
        assert writer.tiers.remote.stats.errors == 0  # an eviction is no error

        reader = make(checkpoint, redis_url=server.url)
        stats = reader.tiers.remote.stats
        hits = []
        for i, ids in reversed(list(enumerate(prompts))):  # newest first: the likeliest to be held
            read_before = stats.read_bytes
            got = run(reader, f"read-{i}", ids)
            same_answer(got, cold(ids))
            assert stats.read_bytes - read_before == redis_tokens(got) // BS * blob_bytes  # nothing read for nothing
            hits.append(redis_tokens(got))
            settle(reader)
        print("redis tokens per prompt:", hits, "of", full(prompts[0]))
        assert stats.errors == 0 and any(hits)
        for engine in (writer, reader):
            engine.close()


def test_redis_refusing_writes_at_maxmemory_drops_those_blocks_and_is_no_outage(checkpoint, cold):
    first, later = prompt(20), prompt(21)
    with redis_server() as server:
        client = server.client()
        writer = make(checkpoint, redis_url=server.url)
        run(writer, "first", first)
        settle(writer)
        limit_memory(client, 0, "noeviction")  # every SET is refused (OOM)
        same_answer(run(writer, "later", later), cold(later))
        settle(writer)
        remote = writer.tiers.remote
        assert remote.stats.dropped_writes >= full(later) // BS and remote.stats.errors >= 1
        assert remote.available  # Redis answered: no pause before the next read
        reader = make(checkpoint, redis_url=server.url)
        assert redis_tokens(run(reader, "read-first", first)) == full(first)  # reads go on
        assert redis_tokens(run(reader, "read-later", later)) == 0
        for engine in (writer, reader):
            engine.close()

