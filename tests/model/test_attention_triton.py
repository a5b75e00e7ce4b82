"""The paged Triton attention kernel (model/attention_triton.py) against the torch path (model/attention.py)
over the same pool, in Triton's interpreter: decode rows, a causal prefill, a slice deep in a cached prefix,
blending's scattered rows, several sequences in one launch, GQA groups (and none), sliding windows, partial
blocks, scattered block tables, split-KV, head dims 64 and 256, fp32/fp16/bf16/fp8/int8 pools and bf16
queries.

On a machine without a GPU these tests run in Triton's interpreter, which needs TRITON_INTERPRET=1 before
triton is imported: tests/test_triton_interpreted.py runs them in a process of their own with it set (here they
skip); with a GPU they run on it."""

from __future__ import annotations

import random

import pytest
import torch

from pools import fill_pool
from reuse_server.kv.pool import KVPool
from reuse_server.model.attention import AttentionMetadata, paged_attention
from reuse_server.model.attention_triton import TritonAttentionKernel, TritonPlan, num_splits, runs_on, tile_shape

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not runs_on(DEVICE), reason="Triton's interpreter is off in this process: "
                                "tests/test_triton_interpreted.py runs these with TRITON_INTERPRET=1")

SEED = 20240545


def _queries(kind: str, ctx: int, rng: random.Random) -> list[int]:
    if kind == "decode":
        return [ctx - 1]
    if kind == "prefill":
        return list(range(ctx))
    if kind == "slice":  # a prefill slice after a cached prefix
        return list(range(ctx - rng.randint(2, min(ctx, 40)), ctx))
    # blending: a scattered subset of the positions, the last one always among them
    return sorted(rng.sample(range(ctx - 1), min(ctx - 1, rng.randint(1, 12)))) + [ctx - 1]


def _step(rng, pool: KVPool, kinds: list[str], max_ctx: int):
    """(metadata, positions) for one sequence per kind, each on blocks drawn at random from the pool."""
    free = list(range(pool.num_blocks))
    rng.shuffle(free)
    starts, tables, lens, positions = [0], [], [], []
    for kind in kinds:
        ctx = rng.randint(2, max_ctx)
        blocks = -(-ctx // pool.block_size)
        tables.append(torch.tensor([free.pop() for _ in range(blocks)], device=pool.device))
        lens.append(ctx)
        positions += _queries(kind, ctx, rng)
        starts.append(len(positions))
    meta = AttentionMetadata(starts, tables, lens, torch.zeros(len(positions), dtype=torch.long, device=pool.device))
    return meta, torch.tensor(positions, device=pool.device)


def _compare(case_seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int, pool_dtype,
             window: int | None, kinds: list[str], splits: int | None, block_n: int | None = None,
             q_dtype=torch.float32, max_ctx: int = 90) -> float:
    """max |triton - torch| / max |torch| for one random step."""
    rng = random.Random(case_seed)
    gen = torch.Generator().manual_seed(case_seed)
    blocks = len(kinds) * -(-max_ctx // block_size) + 3
    pool = KVPool(2, blocks, block_size, kv_heads, head_dim, pool_dtype, DEVICE, read_dtype=q_dtype,
                  native_store=False)
    fill_pool(pool, gen)
    meta, positions = _step(rng, pool, kinds, max_ctx)
    q = torch.randn(positions.shape[0], heads, head_dim, generator=gen).to(DEVICE, q_dtype)
    layer, scale = 1, head_dim ** -0.5
    kernel = TritonAttentionKernel(splits, block_n)
    plan = kernel.plan(meta, positions, pool, heads)
    ours = kernel(q, plan, pool, layer, scale, window)
    theirs = paged_attention(q, meta, meta.sequence_masks(positions, window, q_dtype), pool, layer, scale)
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


MIXED = ["decode", "prefill", "slice", "scattered", "decode"]
# block_n 16: these contexts (up to 90 keys) go through several key tiles (the online softmax's rescaling) and,
# with splits, give each part keys of its own (the merge's weights)
CASES = [
    # heads, kv_heads, head_dim, block_size, pool dtype, window, kinds, splits, block_n
    (9, 3, 64, 16, torch.float32, None, MIXED, None, None),  # SmolLM2's attention shape, all kinds in one launch
    (9, 3, 64, 16, torch.float32, None, MIXED, None, 16),
    (4, 1, 64, 4, torch.float32, 7, MIXED, None, 16),  # a window shorter than a block run, small blocks
    (8, 8, 64, 8, torch.float32, None, ["decode", "scattered"], 3, 16),  # no GQA, split-KV
    (4, 2, 64, 16, torch.float32, 20, ["decode", "decode", "slice"], 4, 16),  # windows with split-KV
    (4, 1, 256, 32, torch.float32, 40, ["prefill", "decode"], None, None),  # Gemma 3 270M's head dim, window
    (8, 2, 64, 16, torch.float16, None, MIXED, None, None),
    (8, 2, 64, 16, torch.bfloat16, None, MIXED, None, None),
    (8, 2, 64, 16, torch.float8_e4m3fn, None, MIXED, None, None),
    (8, 2, 64, 16, torch.float8_e4m3fn, None, ["decode", "decode"], 2, 16),
    (8, 2, 64, 8, torch.int8, 9, MIXED, None, 16),
    (8, 2, 64, 16, torch.int8, None, ["decode", "decode"], 3, 16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_the_torch_path(case):
    heads, kv_heads, head_dim, block_size, pool_dtype, window, kinds, splits, block_n = CASES[case]
    seed = SEED + case
    print("seed", seed)
    err = _compare(seed, heads, kv_heads, head_dim, block_size, pool_dtype, window, kinds, splits, block_n)
    # fp32 arithmetic over the same dequantized values on both sides: only summation order differs
    assert err <= 2e-5, (CASES[case], err)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.int8])
def test_bf16_queries_match_the_torch_path(pool_dtype):
    seed = SEED + 100
    print("seed", seed)
    err = _compare(seed, 8, 2, 64, 16, pool_dtype, None, MIXED, 2, 16, q_dtype=torch.bfloat16)
    assert err <= 2e-2, err  # bf16 probabilities and outputs: a few bf16 ulps


def test_a_step_without_rows_for_a_sequence_leaves_it_out():
    """Blending's row subsets may leave a sequence without query rows: it gets no tile."""
    pool = KVPool(1, 8, 4, 1, 64)
    meta = AttentionMetadata([0, 0, 2], [torch.tensor([0, 1]), torch.tensor([2, 3])], [5, 6],
                             torch.zeros(2, dtype=torch.long))
    plan = TritonPlan(meta.query_start, meta.block_tables, meta.context_lens, torch.tensor([4, 5]), 4, 2, 64)
    assert plan.num_tiles == 1 and plan.tiles.tolist() == [[0, 2, 6, 2]]


def test_tiles_compile_on_a_gpu():
    """What a GPU compiles: tl.dot dims of at least 16, powers of two, K/V tiles within shared memory."""
    for group in (1, 3, 4, 8, 16):
        for head_dim in (64, 128, 256):
            for rows in (1, 200):
                block_m, block_q, block_n = tile_shape(group, head_dim, rows, torch.device("cuda"))
                assert block_m >= 16 and block_n >= 16 and block_q >= 1 and block_q * group <= block_m
                assert all(x & (x - 1) == 0 for x in (block_m, block_n))
                assert 2 * 2 * block_n * triton_pow2(head_dim) * 2 <= 64 * 1024  # K+V, 2 stages, bf16
    assert num_splits(programs=8, longest=8192) == MAX_SPLITS_EXPECTED
    assert num_splits(programs=512, longest=8192) == 1
    assert num_splits(programs=8, longest=100) == 1


MAX_SPLITS_EXPECTED = 16


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_gpu_check_rows_compare_the_kernel_with_the_torch_path():
    """What `make gpu-check` records per kernel shape (benchmarks/gpu_check_kernels.py), on a small shape."""
    from benchmarks.gpu_check_kernels import KernelShape, kernel_rows

    shape = KernelShape("tiny", heads=4, kv_heads=2, head_dim=64, batch=2, context=20, new_rows=3, window=None,
                        kv_dtype="int8", dtype="float32")
    [row] = kernel_rows(DEVICE, [shape], repeats=1)
    assert row["kernel"] == "paged_extend" and row["shape"]["kv_dtype"] == "int8"
    assert 0 <= row["max_abs_err"] <= 1e-4 and row["seconds"] > 0
    assert row["kv_bytes_read"] == 2 * 20 * (2 * 2 * 64 * 1 + 2 * 2 * 4)  # int8 values and fp32 scales, K and V
