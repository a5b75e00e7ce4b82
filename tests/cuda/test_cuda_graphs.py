"""--cuda-graphs and the host tier's pinned entries, on a CUDA device (issue #45). Marked cuda: skipped without
one; `make gpu-check` runs them. The CPU side of both is in tests/engine/test_static_decode.py and
tests/kv/test_host_memory.py."""
import random

import pytest
import torch

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.kv.pool import HostUploads
from reuse_server.kv.tiers.host_memory import PinnedMemory
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.cuda
SEED = 4547


def _run(engine, requests):
    """Add every request, step to the end: request id -> (token ids, logprobs)."""
    for rid, prompt, max_tokens in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3,
                                                       ignore_eos=True))
    outs = {rid: ([], []) for rid, _, _ in requests}
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id][0].extend(out.new_token_ids)
            outs[out.request_id][1].extend(lp.logprob for lp in out.logprobs or [])
    return outs


def test_captured_decode_graphs_replay_what_eager_decode_samples(tiny_llama_path):
    print("seed", SEED)
    rng = random.Random(SEED)
    cfg = dict(model=str(tiny_llama_path), device="cuda", block_size=16, num_gpu_blocks=64, max_num_seqs=4,
               max_model_len=512)
    graphs, eager = build_engine(EngineConfig(cuda_graphs=True, **cfg)), build_engine(EngineConfig(**cfg))
    assert graphs.runner.graphs.buckets == [1, 2, 4] and eager.runner.graphs is None
    # three requests finishing at different steps: decode batches of 3, 2 and 1 (buckets 4, 2, 1)
    requests = [(f"r{i}", [rng.randrange(3, 300) for _ in range(rng.randrange(5, 40))], 3 + 4 * i) for i in range(3)]
    ours, theirs = _run(graphs, requests), _run(eager, requests)
    for rid, (ids, lps) in theirs.items():
        assert ours[rid][0] == ids, rid
        assert ours[rid][1] == pytest.approx(lps, rel=1e-5, abs=1e-5), rid
    assert graphs.runner.steps["graph"] >= 3 and graphs.runner.steps["static"] == 0
    assert eager.runner.steps["graph"] == 0 and eager.runner.steps["static"] >= 3  # eager on the same buffers
    assert graphs.runner.steps["dynamic"] > 0  # the prefills ran eagerly
    assert {4, 2, 1} <= set(graphs.runner.decode_inputs.loads)
    graphs.close()
    eager.close()


def test_cuda_graphs_refuse_a_hybrid_models_layered_pool(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "gemma3", arch="gemma3", seed=8, num_layers=3, sliding_window=6,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="--cuda-graphs: a hybrid model's layered pool"):
        build_engine(EngineConfig(model=str(path), device="cuda", num_gpu_blocks=64, cuda_graphs=True))


def test_host_tier_entries_are_pinned_and_come_back_through_the_upload_stream(tiny_llama_path):
    print("seed", SEED)
    rng = random.Random(SEED + 1)
    engine = build_engine(EngineConfig(model=str(tiny_llama_path), device="cuda", block_size=16, num_gpu_blocks=8,
                                       cpu_cache_size=1 << 26, tier_fetch="always"))
    host = engine.tiers.host
    assert isinstance(host.memory, PinnedMemory)
    prompts = [[rng.randrange(3, 300) for _ in range(50)] for _ in range(3)]
    outs = _run(engine, [(f"r{i}", p, 2) for i, p in enumerate(prompts)])
    entries = host.peek(list(host._entries)).values()
    assert entries and all(entry.payload().is_pinned() for entry in entries)
    uploads = HostUploads.of(torch.device("cuda"))
    uploads.wait()  # forgets the last upload
    again = _run(engine, [("again", prompts[0], 2)])  # out of the 8-block pool by now: read from host RAM
    assert again["again"][0] == outs["r0"][0]
    assert host.stats.read_bytes > 0
    assert uploads._last is not None  # the pinned rows went up on the side stream (KVPool.upload takes only those)
    assert PinnedMemory().copy(torch.arange(4, dtype=torch.uint8)).is_pinned()
    engine.close()
