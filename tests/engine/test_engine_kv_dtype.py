"""--kv-dtype in the engine: the pool stores K/V in the chosen type (auto: the weights'), every reuse path
works on a quantized pool, the fingerprint names the KV dtype, and --kv-cache-memory buys more blocks with a
smaller type, as kv_layout's formula says."""
from __future__ import annotations

import random

import pytest
import torch

from reuse_server.kv import layout as kv_layout
from reuse_server.server.args import engine_config
from reuse_server.server.cli import build_parser
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.kv.pool import KVPool
from reuse_server.engine.sampling_params import SamplingParams
from tiny_checkpoint import write_tiny_checkpoint

BS = 4
QUANTIZED = ["fp16", "bf16", "fp8_e4m3", "int8"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def make_engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), block_size=BS, num_gpu_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
               blend_key_shift=False)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg))


def run(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 8):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1,
                                                   ignore_eos=True))
    ids, logprobs, last = [], [], None
    while engine.has_work():
        for out in engine.step():
            ids += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
            last = out
        engine.cache.check_invariants()
    return ids, logprobs, last


@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_prefix_reuse_on_a_quantized_pool_returns_the_cold_runs_text(checkpoint, kv_dtype, attention):
    """A prompt seen before (full blocks, a partial block copied, the previous answer's tail) gives the text a
    cold run of the same prompt gives on a pool of the same dtype."""
    rng = random.Random(11)
    engine = make_engine(checkpoint, kv_dtype=kv_dtype, attention_backend=attention)
    cold = make_engine(checkpoint, kv_dtype=kv_dtype, attention_backend=attention, enable_prefix_cache=False)
    assert engine.pool.dtype == getattr(torch, kv_layout.kv_dtype(kv_dtype).torch_name)
    assert engine.attention_kernel == (attention == "native")
    first = [rng.randrange(3, engine.vocab_size) for _ in range(30)]
    answer, _, _ = run(engine, "a", first)
    follow = first + answer + [7, 8, 9]  # continues the previous answer, whose last block is a tail
    for rid, prompt in (("again", first), ("follow", follow)):
        warm_ids, warm_lps, out = run(engine, rid, prompt)
        assert out.cached_tokens >= len(first) - 1
        cold_ids, cold_lps, cold_out = run(cold, rid, prompt)
        assert cold_out.cached_tokens == 0
        assert warm_ids == cold_ids
        assert max(abs(a - b) for a, b in zip(warm_lps, cold_lps)) <= 1e-4


def test_kv_dtype_auto_follows_the_weights(checkpoint):
    assert make_engine(checkpoint).pool.dtype == torch.float32
    assert make_engine(checkpoint, dtype="bfloat16").pool.dtype == torch.bfloat16
    engine = make_engine(checkpoint, kv_dtype="int8")  # fp32 weights on the CPU: the kernel reads int8
    assert engine.pool.dtype == torch.int8 and engine.attention_kernel
    assert engine.pool.read(0, torch.arange(4))[0].dtype == torch.float32


def test_kv_cache_memory_buys_more_blocks_with_a_smaller_dtype(checkpoint):
    memory = 1 << 20
    blocks = {}
    for kv_dtype in ("fp32", "bf16", "int8", "fp8_e4m3"):
        engine = make_engine(checkpoint, kv_dtype=kv_dtype, num_gpu_blocks=None, kv_cache_memory=memory)
        kv, mc = engine.pool, engine.model_config
        per_block = kv_layout.bytes_per_block(kv_layout.KVGeometry.uniform(mc.num_layers, mc.num_kv_heads,
                                                                           mc.head_dim),
                                              kv_layout.kv_dtype(kv_dtype), BS)
        assert kv.num_blocks == memory // per_block == engine.snapshot()["total_blocks"]
        assert kv.nbytes == kv.num_blocks * per_block <= memory
        assert per_block == KVPool.bytes_per_block(mc.num_layers, BS, mc.num_kv_heads, mc.head_dim, kv.dtype)
        blocks[kv_dtype] = kv.num_blocks
    assert blocks["fp32"] * 2 == blocks["bf16"] < blocks["int8"] < blocks["fp8_e4m3"] < blocks["fp32"] * 4


def test_the_kv_dtype_is_part_of_the_block_identity(checkpoint):
    prompt = list(range(3, 40))
    hashes = {kv_dtype: make_engine(checkpoint, kv_dtype=kv_dtype).block_hashes(prompt)
              for kv_dtype in ("auto", "bf16", "fp8_e4m3", "int8")}
    assert make_engine(checkpoint, kv_dtype="fp32").block_hashes(prompt) == hashes["auto"]  # auto is fp32 here
    for a in hashes:
        for b in hashes:
            assert a == b or not set(hashes[a]) & set(hashes[b])


def test_cli_and_config_take_the_kv_dtype():
    args = build_parser().parse_args(["serve", "--kv-dtype", "fp8_e4m3"])
    assert engine_config(args).kv_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-dtype", "int4"])
    with pytest.raises(ValueError, match="unknown KV dtype 'int4'"):
        EngineConfig(kv_dtype="int4").validate()


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_blocks_a_previous_owner_filled_compute_as_fresh_ones(checkpoint, kv_dtype):
    """A prompt's partly filled last block and the blocks decode appends to: on an fp8 pool each block's
    scale must come from its new owner's tokens alone, so a pool whose blocks all held large K/V before
    gives exactly the logprobs a fresh pool gives."""
    prompt = list(range(5, 5 + 4 * BS + 2))  # ends 2 tokens into a block
    fresh = make_engine(checkpoint, kv_dtype=kv_dtype)
    used = make_engine(checkpoint, kv_dtype=kv_dtype)
    kv = used.pool
    gen = torch.Generator().manual_seed(12)
    print("seed 12")
    shape = (kv.num_slots, kv.num_kv_heads, kv.head_dim)
    for layer in range(kv.num_layers):  # every block held someone's KV, far larger than the prompt's
        kv.write(layer, torch.arange(kv.num_slots), 1e3 * torch.randn(shape, generator=gen),
                 1e3 * torch.randn(shape, generator=gen))
    want, got = run(fresh, "a", prompt), run(used, "a", prompt)
    assert got[0] == want[0] and got[1] == want[1]
