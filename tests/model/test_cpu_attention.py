"""The CPU attention kernel against a float64 reference over the same paged pool: scattered block tables,
arbitrary query positions (decode, chunks deep in the context, blending's scattered subsets), GQA groups,
sliding windows, several sequences per call, head dims 16 to 128, and the shapes where it splits a
sequence's keys over several tasks or its rows over several units."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pools import fill_pool
from reuse_server.kv.pool import KVPool
from reuse_server.model import cpu_attention, native
from reuse_server.model.attention import AttentionMetadata, paged_attention
from reuse_server.model.cpu_attention import KernelPlan

TOL = 2e-5  # max |kernel - reference| / max |reference|, fp32 against float64


@pytest.fixture(scope="module")
def kernel():
    loaded = cpu_attention.load()
    assert loaded is not None, native.failure()
    return loaded


def reference(q, pool: KVPool, layer, seqs, scale, window):
    """seqs: (block table, context length, query positions) per sequence, queries in q in that order."""
    heads, kv_heads = q.shape[1], pool.num_kv_heads
    out, start = [], 0
    for table, ctx, positions in seqs:
        n = len(positions)
        slots = (table[:, None] * pool.block_size + torch.arange(pool.block_size)).flatten()[:ctx]
        k, v = pool.read(layer, slots)
        k, v = k.double().repeat_interleave(heads // kv_heads, 1), v.double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("thd,khd->htk", q[start:start + n].double(), k) * scale
        pos = torch.tensor(positions)[:, None]
        keys = torch.arange(ctx)[None, :]
        visible = keys <= pos
        if window:
            visible &= keys > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("htk,khd->thd", scores.softmax(-1), v))
        start += n
    return torch.cat(out)


KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]


def run_case(kernel, seqs, heads, kv_heads, head_dim, block_size, window=None, seed=0, dtype=torch.float32):
    """The kernel against the float64 reference over the pool as stored (dequantized: the kernel's own
    arithmetic must add nothing but fp32 rounding, whatever the storage dtype)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-ctx // block_size) for _, ctx, _ in seqs)
    pool = KVPool(2, blocks_needed + 7, block_size, kv_heads, head_dim, dtype)
    fill_pool(pool, gen)
    free = torch.randperm(pool.num_blocks, generator=gen)
    tables, used = [], 0
    for _, ctx, _ in seqs:
        n = -(-ctx // block_size)
        tables.append(free[used:used + n].clone())
        used += n
    cases = [(t, ctx, pos) for t, (_, ctx, pos) in zip(tables, seqs)]
    positions = torch.tensor([p for _, _, pos in seqs for p in pos], dtype=torch.long)
    starts = [0]
    for _, _, pos in seqs:
        starts.append(starts[-1] + len(pos))
    q = torch.randn(len(positions), heads, head_dim, generator=gen)
    plan = KernelPlan(starts, tables, [ctx for _, ctx, _ in seqs], positions, block_size, pool.num_blocks)
    scale = head_dim ** -0.5
    ours = kernel(q, plan, pool, 1, scale, window)
    expected = reference(q, pool, 1, cases, scale, window)
    err = ((ours.double() - expected).abs().max() / expected.abs().max()).item()
    assert err <= TOL, err
    return ours


def last(n, ctx):
    return list(range(ctx - n, ctx))


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2), (6, 1)])
def test_warm_tail_over_a_long_context(kernel, heads, kv_heads, head_dim):
    """A few new tokens after 2,000 cached ones: the keys are split over several tasks and merged."""
    run_case(kernel, [(None, 2000, last(17, 2000))], heads, kv_heads, head_dim, 16)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_decode_batch_of_different_lengths(kernel, block_size):
    lengths = [1, 7, 300, 1500, 64, 65]
    run_case(kernel, [(None, n, [n - 1]) for n in lengths], 9, 3, 64, block_size)


def test_causal_prefill_and_a_chunk_deep_in_the_context(kernel):
    """Many rows per KV head (several units of rows), the causal mask inside each chunk of keys."""
    run_case(kernel, [(None, 300, list(range(300))), (None, 700, list(range(450, 700)))], 9, 3, 64, 16)


def test_scattered_positions_as_blending_recomputes_them(kernel):
    gen = torch.Generator().manual_seed(3)
    chosen = sorted(torch.randperm(999, generator=gen)[:150].tolist()) + [999]
    run_case(kernel, [(None, 1000, chosen)], 9, 3, 64, 16)


@pytest.mark.parametrize("window", [1, 6, 100, 5000])
def test_sliding_window(kernel, window):
    """Keys older than the window are invisible, also where a split task sees none of a row's keys."""
    run_case(kernel, [(None, 1200, last(5, 1200)), (None, 90, list(range(90)))], 8, 2, 32, 4, window=window)


def test_many_sequences_in_one_call(kernel):
    seqs = [(None, 40, list(range(40))), (None, 2100, [2099]), (None, 129, last(3, 129)), (None, 5, [0, 2, 4])]
    run_case(kernel, seqs, 4, 2, 16, 4)


def test_reads_queries_through_a_strided_view(kernel):
    """The model hands over q as a view of its fused q/k projection (a wider token stride)."""
    pool = KVPool(1, 8, 4, 2, 16)
    fill_pool(pool)
    qk = torch.randn(6, 4 + 2, 16)
    plan = KernelPlan([0, 6], [torch.tensor([5, 1])], [6], torch.arange(6), 4, pool.num_blocks)
    strided = kernel(qk[:, :4], plan, pool, 0, 0.25, None)
    dense = kernel(qk[:, :4].contiguous(), plan, pool, 0, 0.25, None)
    assert torch.equal(strided, dense)


@pytest.mark.parametrize("dtype", KV_DTYPES[1:], ids=str)
def test_every_kv_dtype(kernel, dtype):
    """fp16/bf16 widened, fp8 and int8 with their scales (per block / per token): a warm tail split over
    tasks, a decode batch, a causal prefill, a sliding window, over every head width."""
    for head_dim in (16, 32, 64, 128, 256):
        run_case(kernel, [(None, 1100, last(9, 1100))], 9, 3, head_dim, 16, dtype=dtype)
    run_case(kernel, [(None, n, [n - 1]) for n in (1, 7, 300, 65)], 8, 2, 64, 4, dtype=dtype)
    run_case(kernel, [(None, 200, list(range(200))), (None, 90, list(range(40, 90)))], 4, 4, 32, 16, window=50,
             dtype=dtype)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 40, 300])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 1, 32), (4, 4, 16), (4, 1, 64), (4, 1, 256)])
def test_a_token_decoded_alone_has_the_bits_it_has_among_a_prefills_rows(kernel, dtype, window, heads, kv_heads,
                                                                         head_dim):
    """A decode unit (one token's query heads of a KV head) runs keys as vector lanes, a prefill's 64 rows run
    rows as lanes; each token's output must be the same bits either way, or KV cached from a decode step would
    differ from the same tokens prefilled (prefix reuse would not be exact). With a sliding window too: every
    unit's chunks of keys start at a multiple of the chunk, wherever its rows' windows begin."""
    gen = torch.Generator().manual_seed(11)
    print("seed 11")
    bs, ctx = 16, 700  # one task per unit: no split of the keys
    n = 64 // (heads // kv_heads)  # the prefill's tokens: one unit of up to 64 rows per KV head
    pool = KVPool(1, ctx // bs + 9, bs, kv_heads, head_dim, dtype)
    fill_pool(pool, gen)
    table = torch.randperm(pool.num_blocks, generator=gen)[:-(-ctx // bs)]
    q = torch.randn(n, heads, head_dim, generator=gen)
    positions = torch.arange(ctx - n, ctx)
    scale = head_dim ** -0.5
    plan = KernelPlan([0, n], [table], [ctx], positions, bs, pool.num_blocks)
    prefilled = kernel(q, plan, pool, 0, scale, window)
    for i in range(n):
        p = int(positions[i])
        alone = kernel(q[i:i + 1], KernelPlan([0, 1], [table], [p + 1], positions[i:i + 1], bs, pool.num_blocks),
                       pool, 0, scale, window)
        assert torch.equal(alone[0], prefilled[i]), (i, (alone[0] - prefilled[i]).abs().max().item())


# max |attention over the pool - attention over the same K/V in fp32| / max |the latter|, for q, K, V drawn
# from N(0, 1), 1,200 keys: the error the storage dtype costs (about twice what was measured).
CLOSE_TO_FP32 = {torch.float16: 1e-3, torch.bfloat16: 6e-3, torch.float8_e4m3fn: 0.1, torch.int8: 2e-2}


@pytest.mark.parametrize("dtype", list(CLOSE_TO_FP32), ids=str)
def test_attention_on_each_kv_dtype_is_close_to_fp32(kernel, dtype):
    """The kernel and torch's path over a pool of each dtype, against the kernel over an fp32 pool holding
    the same K/V (with a wrong scale, or none, the error is of the output's own size)."""
    gen = torch.Generator().manual_seed(7)
    print("seed 7")
    blocks, bs, kv_heads, heads, hd, ctx = 80, 16, 2, 6, 64, 1200
    k, v = torch.randn(blocks * bs, kv_heads, hd, generator=gen), torch.randn(blocks * bs, kv_heads, hd, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:ctx // bs + 1]
    q = torch.randn(5, heads, hd, generator=gen)
    positions = torch.arange(ctx - 5, ctx)
    outs = {}
    for pool_dtype in (torch.float32, dtype):
        pool = KVPool(1, blocks, bs, kv_heads, hd, pool_dtype)
        pool.write(0, torch.arange(blocks * bs), k, v)
        plan = KernelPlan([0, 5], [table], [ctx], positions, bs, blocks)
        meta = AttentionMetadata([0, 5], [table], [ctx], torch.zeros(5, dtype=torch.long))
        torch_path = paged_attention(q, meta, meta.sequence_masks(positions, None, torch.float32), pool, 0, hd ** -0.5)
        outs[pool_dtype] = (kernel(q, plan, pool, 0, hd ** -0.5, None), torch_path)
    ref = outs[torch.float32][0]
    for out in outs[dtype]:
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert 0 < err <= CLOSE_TO_FP32[dtype], err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_batches(kernel, data):
    kv_heads = data.draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * data.draw(st.sampled_from([1, 2, 3, 5]))
    head_dim = data.draw(st.sampled_from([16, 32, 64, 128, 256]))
    block_size = data.draw(st.sampled_from([1, 2, 8, 16]))
    window = data.draw(st.sampled_from([None, None, 3, 50]))
    seqs = []
    for _ in range(data.draw(st.integers(1, 4))):
        ctx = data.draw(st.integers(1, 1300))
        positions = sorted(data.draw(st.sets(st.integers(0, ctx - 1), min_size=1, max_size=40)))
        seqs.append((None, ctx, positions))
    run_case(kernel, seqs, heads, kv_heads, head_dim, block_size, window, seed=data.draw(st.integers(0, 99)),
             dtype=data.draw(st.sampled_from(KV_DTYPES)))


def test_plan_rejects_what_would_read_outside_the_pool():
    positions = torch.arange(4)
    with pytest.raises(ValueError, match="cannot hold"):
        KernelPlan([0, 4], [torch.tensor([0])], [8], positions, 4, 10)  # one block for 8 positions
    with pytest.raises(ValueError, match="block ids"):
        KernelPlan([0, 4], [torch.tensor([10])], [4], positions, 4, 10)
    with pytest.raises(ValueError, match="query positions"):
        KernelPlan([0, 4], [torch.tensor([0])], [3], positions, 4, 10)  # position 3 outside a context of 3
    with pytest.raises(ValueError, match="cover"):
        KernelPlan([0, 3], [torch.tensor([0])], [4], positions, 4, 10)


def test_takes_fp32_queries_on_the_cpu_over_every_kv_dtype(kernel):
    pool = KVPool(1, 4, 4, 2, 16)
    assert kernel.takes(torch.zeros(3, 4, 16), pool)
    assert not kernel.takes(torch.zeros(3, 4, 16, dtype=torch.bfloat16), pool)
    for dtype in KV_DTYPES:
        assert kernel.takes(torch.zeros(3, 4, 16), KVPool(1, 4, 4, 2, 16, dtype=dtype))
    assert not kernel.takes(torch.zeros(3, 4, 48), KVPool(1, 4, 4, 2, 48))  # head_dim 48: torch's path


def test_a_plan_refuses_positions_and_blocks_outside_their_ranges():
    """The kernel reads K/V at the block tables' ids up to each query's position: a position at or past its
    sequence's context, or a block id outside the pool, would read outside what the sequence owns."""
    tables = [torch.tensor([3, 1]), torch.tensor([0])]
    KernelPlan([0, 2, 3], tables, [20, 5], torch.tensor([18, 19, 4]), 16, 4)  # in range: no error
    for positions in ([18, 20, 4], [18, 19, 5], [-1, 19, 4]):
        with pytest.raises(ValueError, match="query positions"):
            KernelPlan([0, 2, 3], tables, [20, 5], torch.tensor(positions), 16, 4)
    with pytest.raises(ValueError, match="block ids"):
        KernelPlan([0, 2, 3], [torch.tensor([3, 4]), torch.tensor([0])], [20, 5], torch.tensor([18, 19, 4]), 16, 4)
