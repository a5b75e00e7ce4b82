"""What the host tier keeps its entries in (kv/tiers/host_memory.py): pinned memory beside a CUDA pool, plain
memory beside a CPU pool, whose path stays as it was. The pinned side runs in tests/cuda/test_cuda_graphs.py."""
from __future__ import annotations

import random

import torch

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.kv.tiers.host_memory import PageableMemory, PinnedMemory, host_memory_for
from tiny_checkpoint import write_tiny_checkpoint

SEED = 4546


def test_entries_are_pinned_beside_a_cuda_pool_and_plain_beside_any_other():
    assert type(host_memory_for("cuda")) is PinnedMemory and type(host_memory_for("cuda:1")) is PinnedMemory
    assert type(host_memory_for(torch.device("cuda", 0))) is PinnedMemory
    assert type(host_memory_for("cpu")) is PageableMemory and type(host_memory_for("meta")) is PageableMemory
    assert PinnedMemory.pinned and not PageableMemory.pinned


def test_plain_memory_copies_own_their_buffer():
    batch = torch.arange(12, dtype=torch.uint8).view(3, 4)
    row = PageableMemory().copy(batch[1])
    assert torch.equal(row, batch[1]) and row.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    assert row.untyped_storage().nbytes() == 4


def test_a_cpu_engine_host_tier_keeps_plain_memory_and_answers_from_it(tmp_path):
    """A CPU server's host tier: plain memory, its entries the export's rows, and a prompt evicted from the
    pool comes back from it (the CPU path is untouched by the pinned one)."""
    print("seed", SEED)
    path = write_tiny_checkpoint(tmp_path / "tiny", arch="llama", seed=7)
    engine = build_engine(EngineConfig(model=str(path), device="cpu", block_size=4, num_gpu_blocks=12,
                                       cpu_cache_size=1 << 24, blend_key_shift=False))
    host = engine.tiers.host
    assert type(host.memory) is PageableMemory
    rng = random.Random(SEED)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(17)] for _ in range(3)]
    outs = {}
    for i, prompt in enumerate(prompts + prompts[:1]):  # the last: the first again, out of the pool by then
        engine.add_request(f"r{i}", prompt, params)
        while engine.has_work():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
                last = out
    assert host.num_blocks >= 4
    assert not any(entry.payload().is_pinned() for entry in host.peek(list(host._entries)).values())
    assert outs["r3"] == outs["r0"] and last.cached_tokens >= 16
    assert host.stats.read_bytes > 0  # the repeat was read from host RAM
