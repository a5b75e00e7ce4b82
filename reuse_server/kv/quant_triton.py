"""kv/quant.py's arithmetic as Triton device functions, for the kernels that write an 8-bit pool (triton_store.py,
triton_rerope.py): the same scales and the same codes, bit for bit, as the torch path and the C++ store
(model/cpu_kv_store.cpp) compute.

Three things are done by hand rather than by Triton's conversions:
- divisions through `div_rn` (IEEE round to nearest): a GPU's plain fp32 `/` in Triton is an approximate
  division, off by an ulp here and there, which would move a code or a scale;
- rounding to the nearest integer, ties to even (torch.round), from floor: the same on a GPU and in the
  interpreter, with no libdevice call;
- float32 <-> e4m3fn on the bits, as cpu_kv_store.cpp does: Triton's interpreter rounds float32 -> fp8 by
  truncating and adding the cut-off bit without carrying it into the exponent (126.05 becomes 64, not 128) and
  drops the subnormals, so the codes are written as bytes (the pool's fp8 data viewed as uint8)."""
from __future__ import annotations

import triton
import triton.language as tl

from reuse_server.kv import quant as kv_quant

FP8_MAX = tl.constexpr(kv_quant.FP8_MAX)
INT8_MAX = tl.constexpr(kv_quant.INT8_MAX)
FP8_MIN_NORMAL = tl.constexpr(2.0 ** -6)  # e4m3's smallest normal; below it the steps are 2^-9
FP8_SUBNORMAL_STEPS = tl.constexpr(512.0)


@triton.jit
def round_half_even(y):
    """torch.round of fp32 y (|y| < 2^22): the nearest integer, ties to even, as fp32."""
    r = tl.floor(y)
    frac = y - r
    odd = (r.to(tl.int32) & 1) == 1
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def int8_scale(amax):
    """quant.int8_scale: amax / 127."""
    return tl.math.div_rn(amax, INT8_MAX)


@triton.jit
def int8_codes(x, scale):
    """quant.quantize_int8 of fp32 rows x [R, D] at their scales [R]: round(x / scale), saturated, int8."""
    safe = tl.where(scale > 0, scale, 1.0)
    q = round_half_even(tl.math.div_rn(x, safe[:, None]))
    return tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX).to(tl.int8)


@triton.jit
def fp8_scale(amax):
    """quant.fp8_scale: the smallest power of two s with amax <= 448 * s (0 where amax is 0)."""
    bits = tl.math.div_rn(amax, FP8_MAX).to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(x):
    """float8_e4m3fn code (int32 0..255) of fp32 x, saturated at +-448, rounded to nearest even."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    a = tl.abs(x)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    subnormal = round_half_even(a * FP8_SUBNORMAL_STEPS).to(tl.int32)  # 8 is the smallest normal's code
    bits = a.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # the mantissa to 3 bits, ties to even, carrying
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent bias 127 -> 7
    return (sign << 7) | tl.where(a < FP8_MIN_NORMAL, subnormal, normal)


@triton.jit
def e4m3_value(code):
    """fp32 value of float8_e4m3fn codes (int32 0..255; 0x7F, NaN, is never stored: writes saturate)."""
    exponent = (code >> 3) & 0xF
    mantissa = code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * (1.0 / FP8_SUBNORMAL_STEPS), normal)
    return tl.where(code >= 128, -value, value)


@triton.jit
def fp8_block_put(new, new_ok, new_offset, codes_at, scale_at, stride_slot, d, d_ok,
                  BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Write fp32 rows `new` [BLOCK_S, BLOCK_D] (those with new_ok) at offsets new_offset of one block's KV head
    (codes_at: its first slot's codes, uint8; scale_at: its scale), as KVPool._store_fp8 does: the block takes
    the scale its kept tokens (those not written now) and the new ones need together; where that scale is not
    the old one, the kept tokens are re-expressed at it."""
    o = tl.arange(0, BLOCK_S)
    written = tl.max(((new_offset[None, :] == o[:, None]) & new_ok[None, :]).to(tl.int32), axis=1) > 0
    kept_mask = ((o < BLOCK_SIZE) & ~written)[:, None] & d_ok[None, :]
    kept_at = codes_at + o.to(tl.int64)[:, None] * stride_slot + d[None, :]
    kept = e4m3_value(tl.load(kept_at, mask=kept_mask, other=0).to(tl.int32))
    old = tl.load(scale_at)
    kept_amax = tl.max(tl.max(tl.abs(kept), axis=1), axis=0) * old
    new_mask = new_ok[:, None] & d_ok[None, :]
    new_amax = tl.max(tl.max(tl.where(new_mask, tl.abs(new), 0.0), axis=1), axis=0)
    scale = fp8_scale(tl.maximum(kept_amax, new_amax))
    safe = tl.where(scale > 0, scale, 1.0)
    if (scale != old) & (kept_amax > 0):
        tl.store(kept_at, e4m3_bits(tl.math.div_rn(kept * old, safe)).to(tl.uint8), mask=kept_mask)
    new_at = codes_at + new_offset.to(tl.int64)[:, None] * stride_slot + d[None, :]
    tl.store(new_at, e4m3_bits(tl.math.div_rn(new, safe)).to(tl.uint8), mask=new_mask)
    tl.store(scale_at, scale)


@triton.jit
def block_leader(sorted_slots_ptr, t, n_tokens, BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr):
    """For a per-block kernel launched with one program per written slot, slots sorted (so that a block's
    slots lie side by side): (whether slot t is its block's first, so its program owns the block; the block;
    the indices into the sorted slots of the block's written slots [BLOCK_S]; which of them are; their
    offsets in the block)."""
    slot = tl.load(sorted_slots_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    before = tl.load(sorted_slots_ptr + tl.maximum(t - 1, 0)).to(tl.int64) // BLOCK_SIZE
    leads = (t == 0) | (before != block)
    at = t + tl.arange(0, BLOCK_S)
    inside = at < n_tokens
    found = tl.load(sorted_slots_ptr + at, mask=inside, other=0).to(tl.int64)
    ok = inside & (found // BLOCK_SIZE == block)
    return leads, block, at, ok, found - block * BLOCK_SIZE
