"""The KV pool in every storage dtype: quantize/dequantize round trips within each format's error, fp8 blocks
filled by decode appends, partial rewrites, copies, re-RoPE and the key shift on quantized keys, block
export/import (raw and converted to another dtype), and the pool's size against kv_layout's formula."""
from __future__ import annotations

import pytest
import torch

from blend.key_shift import KeyShift, moved_keys
from blend.rope import default_inv_freq, rerope_dense
from reuse_server.kv import layout as kv_layout, quant as kv_quant
from reuse_server.kv.block_codec import BlockLayout
from reuse_server.kv.pool import KVPool

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16, FP8, torch.int8]
QUANTIZED = [FP8, torch.int8]
LAYERS, BLOCKS, BS, HEADS, DIM = 2, 12, 4, 2, 16


def make_pool(dtype, blocks=BLOCKS, block_size=BS):
    return KVPool(LAYERS, blocks, block_size, HEADS, DIM, dtype)


def values(n, seed, heads=HEADS, dim=DIM):
    """K/V-like values whose magnitude varies by token and head (so per-token and per-block scales differ)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=gen) * torch.exp(torch.randn(n, heads, 1, generator=gen))


def assert_within(pool: KVPool, got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, kind: int = 0,
                  layer: int = 0, slack: float = 1.0):
    """|got - want| within the pool format's rounding error of `want` (the values written at slots)."""
    err = (got.float() - want).abs()
    if pool.dtype == torch.float32:
        bound = torch.zeros_like(want)
    elif pool.dtype == torch.float16:
        bound = want.abs() * 2**-11 + 2**-25
    elif pool.dtype == torch.bfloat16:
        bound = want.abs() * 2**-8 + 1e-38
    elif pool.dtype == FP8:  # half an e4m3 step: 2^-4 relative for normal numbers, scale * 2^-10 below them
        scale = pool.layer_scales(layer)[kind][slots // pool.block_size]  # [T, heads]
        bound = want.abs() * 2**-4 + scale[..., None] * 2**-10
    else:  # int8: half a step of the token's own scale
        scale = pool.layer_scales(layer)[kind].reshape(-1, pool.num_kv_heads)[slots]
        bound = scale[..., None] * 0.5 * (1 + 1e-6)
    assert bool((err <= bound * slack + 1e-7).all()), (err - bound * slack).max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_within_the_formats_error(dtype):
    pool = make_pool(dtype)
    slots = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(1))[:30]
    k, v = values(30, 2), values(30, 3)
    pool.write(1, slots, k, v)
    got_k, got_v = pool.read(1, slots)
    assert got_k.dtype == (torch.float32 if pool.quantized else dtype)
    assert_within(pool, got_k, k, slots, kind=0, layer=1)
    assert_within(pool, got_v, v, slots, kind=1, layer=1)
    if dtype == FP8:
        scale = pool.layer_scales(1)[0][slots // BS]  # powers of two, the smallest that hold each block's amax
        assert bool((torch.frexp(scale)[0] == 0.5).all())
    if dtype == torch.int8:  # per token and head: the largest element of each is stored as +-127
        stored = pool.layer_blocks(1)[0].reshape(-1, HEADS, DIM)[slots]
        assert bool((stored.abs().amax(-1) == 127).all())


def test_fp8_scale_is_the_smallest_power_of_two_holding_the_block():
    amax = torch.tensor([448.0, 449.0, 1.0, 3.5, 0.0, 1e-30])
    scale = kv_quant.fp8_scale(amax)
    assert scale.tolist()[:5] == [1.0, 2.0, 2.0**-8, 2.0**-7, 0.0]
    assert bool((amax[:4] <= 448 * scale[:4]).all() and (amax[:4] > 224 * scale[:4]).all())
    assert kv_quant.quantize_fp8(torch.tensor([1000.0]), torch.tensor(1.0)).float().item() == 448.0


def test_fp8_decode_appends_raise_the_block_scale_and_keep_earlier_tokens():
    """Decode writes a block one token at a time, the largest last: each append that needs a larger scale
    rewrites the block at it, so earlier tokens are neither clipped nor rounded twice in the normal range,
    and the block ends up as a one-shot write of the same tokens would leave it."""
    gen = torch.Generator().manual_seed(4)
    block = 5
    slots = torch.arange(block * BS, block * BS + BS)
    ks = [torch.randn(1, HEADS, DIM, generator=gen) * 4.0**i for i in range(BS)]  # each token 4x the last
    appended = make_pool(FP8)
    scales = []
    for i in range(BS):
        appended.write(0, slots[i:i + 1], ks[i], -ks[i])
        scales.append(appended.layer_scales(0)[0][block].clone())
        got, _ = appended.read(0, slots[:i + 1])
        assert_within(appended, got, torch.cat(ks[:i + 1]), slots[:i + 1])  # nothing clipped so far
    assert all(bool((b > a).all()) for a, b in zip(scales, scales[1:]))  # every append raised the scale
    at_once = make_pool(FP8)
    at_once.write(0, slots, torch.cat(ks), -torch.cat(ks))
    assert torch.equal(at_once.layer_scales(0)[0][block], scales[-1])
    got, want = appended.read(0, slots)[0], at_once.read(0, slots)[0]
    normal = want.abs() >= scales[-1][None, :, None] * 2**-6  # below that, e4m3 has fewer mantissa bits
    assert torch.equal(got[normal], want[normal])
    assert (got - want).abs().max() <= scales[-1].max() * 2**-9


def test_fp8_rewriting_some_tokens_keeps_the_others():
    """Blending recomputes a few of a block's tokens: the block's scale follows the tokens it holds now (it
    may fall), and the tokens not rewritten keep their values."""
    pool = make_pool(FP8)
    slots = torch.arange(8, 12)  # block 2
    k = values(4, 5)
    k[1] *= 50  # the block's largest token
    pool.write(0, slots, k, k)
    big = pool.layer_scales(0)[0][2].clone()
    fresh = values(2, 6)
    pool.write(0, slots[[1, 3]], fresh, fresh)  # the large token is replaced
    assert bool((pool.layer_scales(0)[0][2] < big).all())
    want = k.clone()
    want[[1, 3]] = fresh
    assert_within(pool, pool.read(0, slots)[0], want, slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cleared_blocks_forget_the_previous_owner(dtype):
    """A recycled block holds what a fresh pool would, whatever it held before (fp8's block scale)."""
    used, fresh = make_pool(dtype), make_pool(dtype)
    slots = torch.arange(3 * BS, 4 * BS)
    used.write(0, slots, values(BS, 7) * 1000, values(BS, 8) * 1000)
    used.clear_blocks([3])
    for pool in (used, fresh):
        pool.write(0, slots[:2], values(2, 9), values(2, 10))
    for kind in range(2):
        assert torch.equal(used.read(0, slots[:2])[kind], fresh.read(0, slots[:2])[kind])
    if dtype == FP8:
        assert torch.equal(used.layer_scales(0)[0][3], fresh.layer_scales(0)[0][3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copies_carry_values_between_blocks_of_other_scales(dtype):
    pool = make_pool(dtype)
    src, dst = torch.arange(0, 6), torch.tensor([30, 21, 22, 23, 40, 41])  # into blocks with other tokens
    pool.write(0, torch.arange(pool.num_slots), values(pool.num_slots, 11) * 0.01, values(pool.num_slots, 12))
    pool.write(1, torch.arange(pool.num_slots), values(pool.num_slots, 13), values(pool.num_slots, 14) * 30)
    before = [pool.read(layer, src) for layer in range(LAYERS)]
    kept = torch.tensor([20, 31, 42, 43])  # tokens sharing the destination blocks, not copied over
    kept_before = [pool.read(layer, kept) for layer in range(LAYERS)]
    pool.copy_slots(src, dst)
    for layer in range(LAYERS):
        for kind in range(2):
            assert_within(pool, pool.read(layer, dst)[kind], before[layer][kind].float(), dst, kind, layer)
            assert_within(pool, pool.read(layer, kept)[kind], kept_before[layer][kind].float(), kept, kind, layer)
    pool.copy_blocks([0, 1], [7, 9])  # whole blocks: bit for bit, with their scales
    for layer in range(LAYERS):
        k, v = pool.layer_blocks(layer)
        assert torch.equal(k[7].view(torch.uint8), k[0].view(torch.uint8))
        assert torch.equal(v[9].view(torch.uint8), v[1].view(torch.uint8))
        if pool.quantized:
            assert torch.equal(pool.layer_scales(layer)[0][7], pool.layer_scales(layer)[0][0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rerope_and_key_shift_on_quantized_keys(dtype):
    """Dequantize, rotate (and shift), requantize with fresh scales: the keys end where an fp32 pool's
    would, within one more rounding of the format; values and other slots are untouched."""
    inv_freq = default_inv_freq(DIM)
    pool = make_pool(dtype)
    pool.write(0, torch.arange(pool.num_slots), values(pool.num_slots, 15), values(pool.num_slots, 16))
    pool.write(1, torch.arange(pool.num_slots), values(pool.num_slots, 17), values(pool.num_slots, 18))
    slots = torch.tensor([4, 5, 6, 7, 9, 10])
    old, new = torch.arange(6), torch.arange(6) + 1000
    shift = KeyShift(torch.randn(LAYERS, HEADS, DIM, generator=torch.Generator().manual_seed(19)))
    before = [pool.read(layer, torch.arange(pool.num_slots)) for layer in range(LAYERS)]
    pool.update_keys(slots, moved_keys(old, new, inv_freq, shift))
    for layer in range(LAYERS):
        k0 = before[layer][0][slots].float()
        want = rerope_dense(k0, new - old, inv_freq, old_pos=old)
        want = want + rerope_dense(shift.k[layer].expand(len(slots), HEADS, DIM), new, inv_freq,
                                   old_pos=torch.zeros(6, dtype=torch.long))
        k, v = pool.read(layer, torch.arange(pool.num_slots))
        assert_within(pool, k[slots], want, slots, layer=layer, slack=1.01)
        assert torch.equal(v, before[layer][1])  # values are not moved
        others = torch.tensor([s for s in range(pool.num_slots) if s not in slots.tolist()])
        assert_within(pool, k[others], before[layer][0][others].float(), others, layer=layer)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sizes_follow_kv_layouts_formula(dtype):
    pool = make_pool(dtype)
    per_block = kv_layout.bytes_per_block(kv_layout.KVGeometry.uniform(LAYERS, HEADS, DIM), kv_quant.spec(dtype), BS)
    assert pool.layout.nbytes == per_block == KVPool.bytes_per_block(LAYERS, BS, HEADS, DIM, dtype)
    assert pool.nbytes == BLOCKS * per_block
    assert pool.bytes_per_token == per_block / BS
    memory = 100_000
    assert KVPool.from_memory(memory, LAYERS, BS, HEADS, DIM, dtype).num_blocks == memory // per_block


def test_eight_bit_pools_hold_about_four_times_the_tokens():
    fp32 = KVPool.bytes_per_block(30, 16, 3, 64, torch.float32)
    assert KVPool.bytes_per_block(30, 16, 3, 64, "bf16") * 2 == fp32
    # 1 byte an element plus an fp32 scale per block and head (fp8) or per token and head (int8)
    assert KVPool.bytes_per_block(30, 16, 3, 64, FP8) == fp32 // 4 + 30 * 2 * 3 * 4
    assert KVPool.bytes_per_block(30, 16, 3, 64, "int8") == fp32 // 4 + 30 * 2 * 16 * 3 * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_export_import_round_trip_is_exact(dtype):
    pool = make_pool(dtype)
    for layer in range(LAYERS):
        pool.write(layer, torch.arange(pool.num_slots), values(pool.num_slots, 20 + layer),
                   values(pool.num_slots, 30 + layer))
    data = pool.export_blocks([4, 1])
    assert data.dtype == torch.uint8 and data.shape == (2, pool.layout.nbytes) and data.is_contiguous()
    other = make_pool(dtype)
    other.import_blocks([0, 6], data)
    for layer in range(LAYERS):
        for src, dst in ((4, 0), (1, 6)):
            s, d = torch.arange(src * BS, src * BS + BS), torch.arange(dst * BS, dst * BS + BS)
            for kind in range(2):
                assert torch.equal(other.read(layer, d)[kind], pool.read(layer, s)[kind])
    assert torch.equal(other.export_blocks([0, 6]), data)
    # the buffer decodes without a pool, from its layout's description alone
    layout = BlockLayout.from_description(pool.layout.describe())
    decoded = layout.decode(data)  # [n, layers, 2, block, heads, dim]
    assert torch.equal(decoded[0, 1, 0], pool.read(1, torch.arange(16, 20))[0].float())


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8], ids=str)
@pytest.mark.parametrize("tier_dtype", ["fp16", "bf16", "fp8_e4m3", "int8"])
def test_export_in_a_smaller_dtype_and_import_back(pool_dtype, tier_dtype):
    """--tier-kv-dtype: a block leaves the pool in a smaller type and comes back into the pool's own, within
    the smaller type's error."""
    pool = make_pool(pool_dtype)
    pool.write(0, torch.arange(pool.num_slots), values(pool.num_slots, 40), values(pool.num_slots, 41))
    layout = pool.layout_for(tier_dtype)
    data = pool.export_blocks([2, 3], as_dtype=tier_dtype)
    assert data.shape == (2, layout.nbytes)
    back = make_pool(pool_dtype)
    back.import_blocks([5, 6], data, layout)
    probe = make_pool(layout.dtype)  # the tier's own rounding of the same blocks, for the bound
    probe.import_blocks([5, 6], data, layout)
    slots_in, slots_out = torch.arange(8, 16), torch.arange(20, 28)
    for kind in range(2):
        tier = probe.read(0, slots_out)[kind].float()
        original = pool.read(0, slots_in)[kind].float()
        assert_within(probe, tier, original, slots_out, kind)  # the tier copy: the smaller type's error
        assert_within(back, back.read(0, slots_out)[kind], tier, slots_out, kind)  # back: the pool's own
    with pytest.raises(ValueError, match="expected uint8"):
        back.import_blocks([5], data, layout)
    with pytest.raises(ValueError, match="does not fit"):
        back.import_blocks([5, 6], data, BlockLayout(LAYERS, BS * 2, HEADS, DIM, layout.dtype))


def test_layout_describes_its_sections():
    layout = make_pool(FP8).layout
    d = layout.describe()
    assert d["kv_dtype"] == "fp8_e4m3" and d["nbytes"] == layout.nbytes
    values_section, scales_section = d["sections"]
    assert values_section["nbytes"] == scales_section["offset"] == LAYERS * 2 * BS * HEADS * DIM
    assert scales_section["shape"] == [LAYERS, 2, HEADS] and scales_section["per"] == "block"
    assert make_pool(torch.int8).layout.describe()["sections"][1]["shape"] == [LAYERS, 2, BS, HEADS]
    assert len(make_pool(torch.bfloat16).layout.describe()["sections"]) == 1


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_the_cpu_kernel_quantizes_as_torch_does(dtype):
    """The C++ store (the CPU's path) and torch's ops (the GPU's, and the CPU's without a compiler) leave the
    same bytes and scales after the same writes: appends, partial rewrites, copies, re-RoPE; and values on
    rounding ties, at the format's limits and below its normal range."""
    native, plain = make_pool(dtype), KVPool(LAYERS, BLOCKS, BS, HEADS, DIM, dtype, native_store=False)
    assert native._native_store is not None and plain._native_store is None
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float().nan_to_num(0.0)
    ties = (codes[1:127] + codes[:126]) / 2  # halfway between neighbouring codes: rounds to the even one
    special = torch.cat([codes, ties, -ties, torch.tensor([1000.0, -500.0, 1e-12, -0.0])])
    special = special[:len(special) // (HEADS * DIM) * HEADS * DIM].view(-1, HEADS, DIM)
    for pool in (native, plain):
        pool.write(0, torch.arange(len(special)), special, special * 3)
        pool.write(1, torch.arange(pool.num_slots), values(pool.num_slots, 50), values(pool.num_slots, 51))
        for i in range(6):  # decode appends into block 9, growing
            pool.write(0, torch.tensor([36 + i % 4]), values(1, 60 + i) * 3.0**i, values(1, 70 + i))
        pool.write(1, torch.tensor([5, 17, 18]), values(3, 80) * 100, values(3, 81) / 100)
        pool.copy_slots(torch.tensor([1, 2, 3, 30]), torch.tensor([44, 45, 12, 13]))
        move = moved_keys(torch.arange(3), torch.arange(3) + 77, default_inv_freq(DIM))
        pool.update_keys(torch.tensor([44, 45, 12]), move)
    assert torch.equal(native._data.view(torch.uint8), plain._data.view(torch.uint8))
    assert torch.equal(native._scales, plain._scales)
