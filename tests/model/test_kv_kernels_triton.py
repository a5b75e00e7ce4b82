"""The KV pool's Triton kernels against its torch path, in Triton's interpreter: the store kernel
(kv/triton_store.py, KVPool.write with use_triton_kernels) must leave the pool's bytes and scales exactly as
torch's ops (or the C++ store) leave them, for every storage dtype, random rows, scattered slots and blocks
filled a few tokens at a time; the 8-bit re-RoPE in place (kv/triton_rerope.py, KVPool.update_keys) must give
the torch path's keys within a quantization step and touch nothing else.

On a machine without a GPU these run in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported):
tests/test_triton_interpreted.py runs them in a process of their own with it set; here they skip."""
from __future__ import annotations

import random

import pytest
import torch

from blend.key_shift import KeyShift, moved_keys
from blend.rope import default_inv_freq
from reuse_server.kv.layered_pool import LayeredKVPool
from reuse_server.kv.pool import KVPool
from reuse_server.model.attention_triton import runs_on

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not runs_on(DEVICE), reason="Triton's interpreter is off in this process: "
                                "tests/test_triton_interpreted.py runs these with TRITON_INTERPRET=1")
SEED = 20261205
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn]


def pools(dtype, layers=2, blocks=10, block_size=4, heads=2, head_dim=64):
    """(torch pool, Triton pool) of the same shape, both empty."""
    ref = KVPool(layers, blocks, block_size, heads, head_dim, dtype, DEVICE, native_store=False)
    ours = KVPool(layers, blocks, block_size, heads, head_dim, dtype, DEVICE, native_store=False)
    assert ours.use_triton_kernels() and not ref.rotates_in_place
    return ref, ours


def assert_same_bytes(ours: KVPool, ref: KVPool) -> None:
    assert torch.equal(ours._data.view(torch.uint8), ref._data.view(torch.uint8))
    assert (ours._scales is None) == (ref._scales is None)
    if ref._scales is not None:
        assert torch.equal(ours._scales, ref._scales)


def rows(gen, n, heads, head_dim, dtype, rng):
    """Random rows at a random magnitude; some of them tiny (e4m3's subnormals) or at rounding ties."""
    x = torch.randn(n, heads, head_dim, generator=gen) * rng.choice([1e-3, 1.0, 30.0])
    x[0, 0, :4] = torch.tensor([126.05, -2.5e-3, 1.5, -0.5])  # 126.05 rounds up across a power of two in e4m3
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,heads,head_dim", [(4, 2, 64), (5, 3, 32)])
def test_store_kernel_writes_the_torch_paths_bytes(dtype, block_size, heads, head_dim):
    """Scattered slots, a few at a time into the same blocks (decode appends: an fp8 block's scale grows and
    its kept tokens are re-expressed), fp32 and bf16 rows."""
    seed = SEED + DTYPES.index(dtype) * 10 + block_size
    print("seed", seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ref, ours = pools(dtype, blocks=6, block_size=block_size, heads=heads, head_dim=head_dim)
    free = [rng.sample(range(ref.num_slots), ref.num_slots) for _ in range(ref.num_layers)]  # per layer
    for step in range(4):
        n = rng.randint(1, 9)
        layer = step % 2
        slots = torch.tensor([free[layer].pop() for _ in range(n)], device=DEVICE)
        row_dtype = torch.bfloat16 if step > 1 else torch.float32
        k, v = (rows(gen, n, heads, head_dim, row_dtype, rng) for _ in range(2))
        ref.write(layer, slots, k, v)
        ours.write(layer, slots, k, v)
        assert_same_bytes(ours, ref)
    assert ours.kernel_launches["store"] == 4 and ref.kernel_launches["store"] == 0


def test_store_kernel_takes_keys_as_a_view_of_a_wider_projection():
    """The model hands K as a view of its packed q/k projection (a wider token stride)."""
    print("seed", SEED)
    gen = torch.Generator().manual_seed(SEED)
    ref, ours = pools(torch.int8, heads=2, head_dim=64)
    qk = torch.randn(7, 6, 64, generator=gen).to(DEVICE)
    k, v = qk[:, 4:], torch.randn(7, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([3, 9, 10, 11, 30, 31, 0], device=DEVICE)
    ref.write(0, slots, k, v)
    ours.write(0, slots, k, v)
    assert_same_bytes(ours, ref)


def filled(dtype, gen, **shape):
    """(torch pool, Triton pool) holding the same random K/V in every slot."""
    ref, ours = pools(dtype, **shape)
    slots = torch.arange(ref.num_slots, device=DEVICE)
    for layer in range(ref.num_layers):
        k, v = (torch.randn(ref.num_slots, ref.num_kv_heads, ref.head_dim, generator=gen).to(DEVICE)
                for _ in range(2))
        ref.write(layer, slots, k, v)
        ours.write(layer, slots, k, v)
    return ref, ours


def quant_steps(pool: KVPool) -> torch.Tensor:
    """Per layer, slot and KV head, the size of one quantization step: [layers, slots, heads, 1]."""
    scales = pool._scales[:, 0]
    if pool.scale_per == "block":
        scales = scales.repeat_interleave(pool.block_size, 1)
    return scales.reshape(pool.num_layers, pool.num_slots, pool.num_kv_heads, 1)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size,heads,head_dim", [(4, 2, 64), (16, 1, 32)])
def test_rerope_in_place_matches_the_torch_path(dtype, block_size, heads, head_dim):
    """Scattered slots (some blocks moved in part: an fp8 block's kept keys share its new scale), each layer
    with its own RoPE base (Gemma 3's two), positions moved thousands ahead."""
    seed = SEED + 7 + block_size
    print("seed", seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ref, ours = filled(dtype, gen, layers=3, blocks=6, block_size=block_size, heads=heads, head_dim=head_dim)
    before = ours._data.clone(), ours._scales.clone()
    n = rng.randint(5, 20)
    moved = torch.tensor(rng.sample(range(ref.num_slots), n), device=DEVICE)
    old = torch.randint(0, 4000, (n,), generator=gen)
    new = old + torch.randint(1, 4000, (n,), generator=gen)
    table = torch.stack([default_inv_freq(head_dim, base) for base in (1e4, 1e6, 1e4)])
    ref.update_keys(moved, moved_keys(old, new, table))
    ours.update_keys(moved, moved_keys(old, new, table))
    assert ours.kernel_launches["rerope"] == 1

    everywhere = torch.arange(ref.num_slots, device=DEVICE)
    ref_keys, our_keys = torch.stack(ref.read_keys(everywhere)), torch.stack(ours.read_keys(everywhere))
    step = torch.maximum(quant_steps(ref), quant_steps(ours))
    assert ((our_keys - ref_keys).abs() <= step * 1.01 + 1e-6).all()  # within one step of the quantization
    codes_equal = (ours._data[:, 0].view(torch.uint8) == ref._data[:, 0].view(torch.uint8)).float().mean().item()
    assert codes_equal > 0.99, codes_equal
    # the moved keys did move; V and the other blocks' keys did not
    flat = ours._data[:, 0].reshape(3, ours.num_slots, heads, head_dim)
    was = before[0][:, 0].reshape(3, ours.num_slots, heads, head_dim)
    assert not torch.equal(flat[:, moved], was[:, moved])
    assert torch.equal(ours._data[:, 1].view(torch.uint8), before[0][:, 1].view(torch.uint8))
    untouched = torch.ones(ours.num_blocks, dtype=torch.bool)
    untouched[torch.div(moved, block_size, rounding_mode="floor").cpu()] = False
    by_block = ours._data[:, 0].view(torch.uint8)
    assert torch.equal(by_block[:, untouched.to(DEVICE)], before[0][:, 0].view(torch.uint8)[:, untouched.to(DEVICE)])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_key_shift_is_added_in_the_same_pass(dtype):
    """A KeyMove that also adds the key shift (rotated to each key's new position) is one launch too, and gives
    the torch path's keys (rotate, add, in fp32 copies, quantize once) within a quantization step."""
    seed = SEED + 5
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    shape = dict(layers=2, blocks=6, block_size=4, heads=2, head_dim=64)
    ref, ours = filled(dtype, gen, **shape)
    moved = torch.tensor([1, 2, 3, 17, 20], device=DEVICE)
    old, new = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([40, 41, 42, 3000, 3001])
    shift = KeyShift(torch.randn(2, 2, 64, generator=gen))
    table = torch.stack([default_inv_freq(64, 1e4), default_inv_freq(64, 1e6)])
    ref.update_keys(moved, moved_keys(old, new, table, shift))
    ours.update_keys(moved, moved_keys(old, new, table, shift))
    assert ours.kernel_launches["rerope"] == 1
    everywhere = torch.arange(ref.num_slots, device=DEVICE)
    ref_keys, our_keys = torch.stack(ref.read_keys(everywhere)), torch.stack(ours.read_keys(everywhere))
    step = torch.maximum(quant_steps(ref), quant_steps(ours))
    assert ((our_keys - ref_keys).abs() <= step * 1.01 + 1e-6).all()
    unshifted = filled(dtype, torch.Generator().manual_seed(seed), **shape)[1]  # the same keys, moved unshifted
    unshifted.update_keys(moved, moved_keys(old, new, table))
    assert (torch.stack(unshifted.read_keys(everywhere)) - our_keys).abs().amax() > 10 * step.amax()


def test_a_hybrid_pool_rotates_each_pool_with_its_own_layers_bases():
    """Gemma 3's layered pool: full-attention and window layers in two int8 pools, each moved in place with its
    layers' rows of the table and of the key shift (window slots translated)."""
    seed = SEED + 3
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    windows = (4, 4, None)
    ref, ours = (LayeredKVPool(windows, 8, 6, 4, 1, 32, "int8", DEVICE) for _ in range(2))
    assert ours.use_triton_kernels()
    blocks = [1, 2, 3]
    for pool in (ref, ours):
        assert pool.parts.attach(blocks)  # a window part for each block (the block manager's call, normally)
    slots = torch.tensor([b * 4 + o for b in blocks for o in range(4)], device=DEVICE)
    for layer in range(3):
        k, v = (torch.randn(len(slots), 1, 32, generator=gen).to(DEVICE) for _ in range(2))
        ref.write(layer, slots, k, v)
        ours.write(layer, slots, k, v)
    table = torch.stack([default_inv_freq(32, base) for base in (1e4, 1e4, 1e6)])
    moved, old = slots[2:9], torch.arange(2, 9)
    shift = KeyShift(torch.randn(3, 1, 32, generator=gen))  # each pool adds its own layers' rows
    ref.update_keys(moved, moved_keys(old, old + 500, table, shift))
    ours.update_keys(moved, moved_keys(old, old + 500, table, shift))
    assert ours.full.kernel_launches["rerope"] == 1 and ours.windowed.kernel_launches["rerope"] == 1
    for layer in range(3):
        step = 2 * max(ref.read(layer, moved)[0].abs().max().item(), 1e-6) / 127
        assert (ours.read(layer, moved)[0] - ref.read(layer, moved)[0]).abs().max().item() <= step


def test_gpu_check_rows_compare_the_pool_kernels_with_the_torch_path():
    """What `make gpu-check` records for the store and the 8-bit re-RoPE (benchmarks/gpu_check_kernels.py)."""
    from benchmarks.gpu_check_kernels import CPU_REROPE_SHAPES, CPU_STORE_SHAPES, rerope_rows, store_rows

    stores = store_rows(DEVICE, CPU_STORE_SHAPES, repeats=1)
    assert [r["shape"]["kv_dtype"] for r in stores] == ["float32", "int8", "fp8_e4m3"]
    assert all(r["kernel"] == "kv_store" and r["max_abs_err"] == 0.0 and r["seconds"] > 0 for r in stores)
    fp32 = stores[0]  # 12 rows of K and V, 3 heads x 64 dims, fp32 in and out
    assert fp32["kv_bytes_read"] == fp32["kv_bytes_written"] == 2 * 12 * 3 * 64 * 4
    moves = rerope_rows(DEVICE, CPU_REROPE_SHAPES, repeats=1)
    assert [r["kernel"] for r in moves] == ["rerope_8bit"] * 2
    for row in moves:  # within a quantization step of keys of |x| up to ~5
        assert 0 <= row["max_abs_err"] <= 0.1 and row["bytes_moved"] == row["kv_bytes_read"] + row["kv_bytes_written"]
    assert moves[0]["kv_bytes_written"] == 2 * (12 * 3 * 64 + 12 * 3 * 4)  # int8 codes and scales, 2 layers
