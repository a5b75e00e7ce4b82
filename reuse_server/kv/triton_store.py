"""A step's new K and V rows into their slots of one layer's pool, in one Triton launch (KVPool.write with
`use_triton_kernels`): fp32/fp16/bf16 pools cast, int8 pools quantize each (slot, KV head) with its scale,
fp8 pools quantize each block at the scale its kept and new tokens need together, all as kv/quant.py and
KVPool._store_planes do (quant_triton.py has the arithmetic), so the torch reads, the C++ kernel and the
paged Triton attention read the rows back unchanged.

Facts taken from vLLM's `reshape_and_cache_flash` (its Triton version) and SGLang's `set_kv_buffer`: one
launch writes K and V together, each program a tile of tokens reading its slot from the slot mapping, the
cache laid out as [blocks, block_size, kv_heads, head_dim] per layer. What differs here: our 8-bit scales are
per (slot, head) for int8 and per (block, head) for fp8 (vLLM's fp8 cache takes one scale per layer), so an fp8
write is a per-block operation: the slots are sorted (a block's written slots then lie side by side) and the
program of a block's first written slot rewrites that block's KV head; the others have nothing to do. Slots
must be distinct, as for every pool write."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reuse_server.kv.quant_triton import block_leader, fp8_block_put, int8_codes, int8_scale

FP8 = torch.float8_e4m3fn


@triton.jit
def _put_rows(src_at, dst_at, scale_at, row_ok, d, d_ok, INT8: tl.constexpr):
    """Rows [R, D] from src_at into dst_at: cast, or int8 codes with their scales at scale_at."""
    mask = row_ok[:, None] & d_ok[None, :]
    x = tl.load(src_at[:, None] + d[None, :], mask=mask, other=0.0)
    if INT8:
        x = x.to(tl.float32)
        scale = int8_scale(tl.max(tl.abs(x), axis=1))
        tl.store(dst_at[:, None] + d[None, :], int8_codes(x, scale), mask=mask)
        tl.store(scale_at, scale, mask=row_ok)
    elif dst_at.dtype.element_ty == tl.bfloat16:
        tl.store(dst_at[:, None] + d[None, :], _bf16(x), mask=mask)
    else:
        tl.store(dst_at[:, None] + d[None, :], x.to(dst_at.dtype.element_ty), mask=mask)


@triton.jit
def _bf16(x):
    """x in bf16, rounded to nearest even as torch rounds: on the bits first, so that the conversion is exact
    (Triton's interpreter converts float32 -> bf16 by truncating)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000
    x = x.to(tl.float32)
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True)).to(tl.bfloat16)  # a NaN stays one


@triton.jit
def _store_rows(
    k_ptr, v_ptr, slots_ptr, k_dst, v_dst, k_scales, v_scales, n_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head, stride_ss, stride_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr,
):
    """Plain and int8 pools: each row of the tile is one (token, KV head)."""
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = tl.program_id(0) * BLOCK_T + rows // BLOCK_H
    head = (rows % BLOCK_H).to(tl.int64)
    tok_ok = tok < n_tokens
    row_ok = tok_ok & (head < NUM_HEADS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    slot = tl.load(slots_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    tok = tok.to(tl.int64)
    at = slot * stride_slot + head * stride_head
    scale_at = slot * stride_ss + head * stride_sh
    _put_rows(k_ptr + tok * stride_kt + head * stride_kh, k_dst + at, k_scales + scale_at, row_ok, d, d_ok, INT8)
    _put_rows(v_ptr + tok * stride_vt + head * stride_vh, v_dst + at, v_scales + scale_at, row_ok, d, d_ok, INT8)


@triton.jit
def _store_fp8_blocks(
    k_ptr, v_ptr, sorted_ptr, order_ptr, k_dst, v_dst, k_scales, v_scales, n_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_block, stride_slot, stride_head, stride_sb, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """fp8 pools: program (t, head) rewrites the block of sorted slot t's KV head if t is its first slot."""
    t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    leads, block, at, ok, offset = block_leader(sorted_ptr, t, n_tokens, BLOCK_SIZE, BLOCK_S)
    if leads:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        row = tl.load(order_ptr + at, mask=ok, other=0).to(tl.int64)
        mask = ok[:, None] & d_ok[None, :]
        codes_at = block * stride_block + head * stride_head
        scale_at = block * stride_sb + head * stride_sh
        k = tl.load(k_ptr + (row * stride_kt + head * stride_kh)[:, None] + d[None, :], mask=mask, other=0.0)
        fp8_block_put(k.to(tl.float32), ok, offset, k_dst + codes_at, k_scales + scale_at, stride_slot, d, d_ok,
                      BLOCK_SIZE, BLOCK_S)
        v = tl.load(v_ptr + (row * stride_vt + head * stride_vh)[:, None] + d[None, :], mask=mask, other=0.0)
        fp8_block_put(v.to(tl.float32), ok, offset, v_dst + codes_at, v_scales + scale_at, stride_slot, d, d_ok,
                      BLOCK_SIZE, BLOCK_S)


def _rows_per_program(block_h: int, block_d: int) -> int:
    """Tokens per program: about 4k elements of K (and as many of V) per program, at least one token."""
    return max(1, min(64, 4096 // (block_h * block_d)))


def store(data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] (any float dtype; views with a wider token stride are fine) into slots [T]
    (distinct, on the pool's device) of one layer's pool: data [2 (K, V), blocks, block_size, kv_heads,
    head_dim] in any of the pool's dtypes, scales its [2, blocks, kv_heads] (fp8) or [2, blocks, block_size,
    kv_heads] (int8), None for the plain dtypes."""
    n = slots.shape[0]
    if n == 0:
        return
    _, _, block_size, kv_heads, head_dim = data.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if data.stride(-1) != 1 or data.stride(1) != block_size * data.stride(2) or k.shape != v.shape:
        raise ValueError("the pool's slots must be [blocks * block_size] rows with the head dim innermost")
    if scales is not None and data.dtype == torch.int8 and scales.stride(1) != block_size * scales.stride(2):
        raise ValueError("an int8 pool's scales must be [blocks * block_size] rows of slots")
    block_d = triton.next_power_of_2(head_dim)
    if data.dtype == FP8:
        codes = data.view(torch.uint8)
        sorted_slots, order = torch.sort(slots)
        _store_fp8_blocks[(n, kv_heads)](
            k, v, sorted_slots, order, codes[0], codes[1], scales[0], scales[1], n,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), data.stride(1), data.stride(2), data.stride(3),
            scales.stride(1), scales.stride(2),
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_S=triton.next_power_of_2(block_size), BLOCK_D=block_d)
        return
    int8 = data.dtype == torch.int8
    block_h = triton.next_power_of_2(kv_heads)
    block_t = _rows_per_program(block_h, block_d)
    if int8:  # [2, blocks, block_size, heads]: a slot's scales are block_size-th of a block's
        scale_k, scale_v, stride_ss, stride_sh = scales[0], scales[1], scales.stride(2), scales.stride(3)
    else:
        scale_k, scale_v, stride_ss, stride_sh = data[0], data[1], 0, 0  # not read
    _store_rows[(triton.cdiv(n, block_t),)](
        k, v, slots, data[0], data[1], scale_k, scale_v, n,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), data.stride(2), data.stride(3), stride_ss, stride_sh,
        NUM_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, INT8=int8)
