"""A bounded soak (benchmarks/soak.py): many concurrent streaming and non-streaming clients for ~45 s on a
small pool (so eviction and preemption happen), mixed prompt lengths, shared prefixes, blended RAG chats,
precomputed documents, n > 1, and a quarter of the clients leaving at random points. Afterwards no request
runs or waits, no KV block is in use (no lock left), free + evictable == total, and a fixed greedy probe
answers exactly as before. The seed is printed; SOAK_SEED=... replays a run's traffic (timing still varies).
`python -m benchmarks.bench_soak` runs it longer, for the figures."""
import os
import random

import pytest

from benchmarks.soak import probe, run_soak, settled_pool
from server_process import running_server
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
DURATION_S = float(os.environ.get("SOAK_SECONDS", 45))
CLIENTS = 16
NUM_BLOCKS = 768


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-4-layers"), arch="llama", num_layers=4)
    log_path = tmp_path_factory.mktemp("soak") / "server.log"
    with running_server(checkpoint, log_path, "--block-size", "4", "--num-gpu-blocks", str(NUM_BLOCKS),
                        "--max-model-len", "2048", "--max-num-seqs", "8", "--blend", "--blend-min-tokens", "8",
                        served_name=MODEL) as url:
        yield url


def test_soak_leaves_no_block_no_lock_and_the_same_answers(server):
    seed = int(os.environ.get("SOAK_SEED", random.randrange(1 << 30)))
    print(f"soak seed {seed}")
    before = probe(server, MODEL)
    result = run_soak(server, MODEL, DURATION_S, CLIENTS, seed, max_prompt_words=150)
    print("soak", result.summary())
    assert not result.errors, result.errors[:5]
    assert result.completed > 100 and result.disconnects > 10
    assert {"prefix", "chat", "blend", "precompute", "long"} <= set(result.kinds)
    pool = settled_pool(server)
    print("pool after the soak", pool)
    assert pool["in_use"] == 0 and pool["requests_running"] == 0 and pool["requests_waiting"] == 0
    assert pool["free"] + pool["evictable"] == pool["kv_blocks_total"] == NUM_BLOCKS
    assert pool["blended_tokens_total"] > 0 and pool["evicted_blocks_total"] > 0  # both paths were exercised
    assert probe(server, MODEL) == before
