"""Re-RoPE in place on an 8-bit pool's keys, every layer in one Triton launch (KVPool.update_keys with
`use_triton_kernels`, for blending's moved chunks): read the codes and their scale, rotate from the old
position to the new one (blend/rope_triton.py's angles, each layer with its own row of the inverse-frequency
table), quantize again and write codes and scale back, where the torch path dequantizes the keys into fp32
copies, rotates them and stores them through the pool's write (some thirty small operations a layer).

The result is the torch path's up to the last bit of the rotation (cos and sin in the kernel's float32 against
torch's float64 rounded): a code may move by one step, a scale by an ulp. Quantizing is quant_triton.py's,
the torch path's arithmetic:
- int8 (a scale per slot and KV head): each moved (slot, head) row on its own;
- fp8 (a scale per block and KV head): the slots sorted, the program of a block's first moved slot rewrites
  that block's KV head as a pool write does (kept tokens re-expressed where the block's scale changes).
A key shift (blend/key_shift.py: a per-layer vector before RoPE, rotated to the new position and added) is added
in the same pass, after the rotation, as the torch path adds it to its fp32 copies, so the keys are quantized
once for both."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blend.rope_triton import rotation_cos_sin
from reuse_server.kv.quant_triton import block_leader, e4m3_value, fp8_block_put, int8_codes, int8_scale

FP8 = torch.float8_e4m3fn


@triton.jit
def _rotated(x, partner, p_old, p_new, freq_ptr, d, d_ok, HALF: tl.constexpr, MATCH_FP32: tl.constexpr):
    """Rows x [R, D] rotated from p_old to p_new [R]; partner holds each element's pair (x2 for x1, x1 for x2):
    x1*cos - x2*sin, x2*cos + x1*sin (blend/rope.py's _rotate)."""
    first = d < HALF
    f = tl.load(freq_ptr + tl.where(first, d, d - HALF), mask=d_ok, other=0.0)
    cos, sin = rotation_cos_sin(p_old[:, None], p_new[:, None], f[None, :], MATCH_FP32)
    return x * cos + tl.where(first[None, :], -partner, partner) * sin


@triton.jit
def _moved(x, partner, p_old, p_new, freq_ptr, shift_at, d, d_ok,
           HALF: tl.constexpr, HEAD_DIM: tl.constexpr, MATCH_FP32: tl.constexpr, SHIFTED: tl.constexpr):
    """Rows x [R, D] moved from p_old to p_new [R], and with SHIFTED the shift rows at shift_at ([R] pointers to
    each row's head's shift) rotated to p_new (from 0, the model's own fp32 angles) and added."""
    y = _rotated(x, partner, p_old, p_new, freq_ptr, d, d_ok, HALF, MATCH_FP32)
    if SHIFTED:
        shift = tl.load(shift_at[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
        shift_partner = tl.load(shift_at[:, None] + ((d + HALF) % HEAD_DIM)[None, :], mask=d_ok[None, :], other=0.0)
        y = y + _rotated(shift, shift_partner, p_new * 0, p_new, freq_ptr, d, d_ok, HALF, True)
    return y


@triton.jit
def _rerope_int8(
    codes_ptr, scales_ptr, slots_ptr, old_ptr, new_ptr, freq_ptr, shift_ptr, n_tokens,
    stride_cl, stride_cs, stride_ch, stride_sl, stride_ss, stride_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, MATCH_FP32: tl.constexpr,
    SHIFTED: tl.constexpr,
):
    """Program (tile, layer): each row of the tile one moved (slot, KV head) of that layer."""
    layer = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = tl.program_id(0) * BLOCK_T + rows // BLOCK_H
    head = (rows % BLOCK_H).to(tl.int64)
    tok_ok = tok < n_tokens
    row_ok = tok_ok & (head < NUM_HEADS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    slot = tl.load(slots_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    p_old = tl.load(old_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    p_new = tl.load(new_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    at = (layer * stride_cl + slot * stride_cs + head * stride_ch)[:, None]
    scale_at = scales_ptr + layer * stride_sl + slot * stride_ss + head * stride_sh
    mask = row_ok[:, None] & d_ok[None, :]
    old_scale = tl.load(scale_at, mask=row_ok, other=0.0)[:, None]
    x = tl.load(codes_ptr + at + d[None, :], mask=mask, other=0).to(tl.float32) * old_scale
    partner = tl.load(codes_ptr + at + ((d + HALF) % HEAD_DIM)[None, :], mask=mask, other=0).to(tl.float32)
    shift_at = shift_ptr + (layer * NUM_HEADS + head) * HEAD_DIM
    y = _moved(x, partner * old_scale, p_old, p_new, freq_ptr + layer * HALF, shift_at, d, d_ok, HALF, HEAD_DIM,
               MATCH_FP32, SHIFTED)
    y = tl.where(mask, y, 0.0)
    scale = int8_scale(tl.max(tl.abs(y), axis=1))
    tl.store(codes_ptr + at + d[None, :], int8_codes(y, scale), mask=mask)
    tl.store(scale_at, scale, mask=row_ok)


@triton.jit
def _rerope_fp8_blocks(
    codes_ptr, scales_ptr, sorted_ptr, order_ptr, old_ptr, new_ptr, freq_ptr, shift_ptr, n_tokens,
    stride_cl, stride_cb, stride_cs, stride_ch, stride_sl, stride_sb, stride_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, MATCH_FP32: tl.constexpr, SHIFTED: tl.constexpr,
):
    """Program (t, head, layer): if sorted slot t is its block's first moved slot, rotates that block's moved
    keys of this KV head and layer and rewrites the block at the scale they and its kept keys need."""
    t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    leads, block, at, ok, offset = block_leader(sorted_ptr, t, n_tokens, BLOCK_SIZE, BLOCK_S)
    if leads:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        row = tl.load(order_ptr + at, mask=ok, other=0).to(tl.int64)
        p_old = tl.load(old_ptr + row, mask=ok, other=0).to(tl.int64)
        p_new = tl.load(new_ptr + row, mask=ok, other=0).to(tl.int64)
        codes_at = codes_ptr + layer * stride_cl + block * stride_cb + head * stride_ch
        scale_at = scales_ptr + layer * stride_sl + block * stride_sb + head * stride_sh
        old_scale = tl.load(scale_at)
        mask = ok[:, None] & d_ok[None, :]
        moved_at = codes_at + offset.to(tl.int64)[:, None] * stride_cs
        x = e4m3_value(tl.load(moved_at + d[None, :], mask=mask, other=0).to(tl.int32)) * old_scale
        partner = e4m3_value(tl.load(moved_at + ((d + HALF) % HEAD_DIM)[None, :], mask=mask, other=0).to(tl.int32))
        shift_at = shift_ptr + (layer * NUM_HEADS + head) * HEAD_DIM + row * 0
        y = _moved(x, partner * old_scale, p_old, p_new, freq_ptr + layer * HALF, shift_at, d, d_ok, HALF,
                   HEAD_DIM, MATCH_FP32, SHIFTED)
        fp8_block_put(y, ok, offset, codes_at, scale_at, stride_cs, d, d_ok, BLOCK_SIZE, BLOCK_S)


def rerope_(keys: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, old_pos: torch.Tensor,
            new_pos: torch.Tensor, inv_freq: torch.Tensor, shift: torch.Tensor | None = None, *,
            match_fp32_angles: bool = True) -> None:
    """Move the keys at slots [n] (distinct) of every layer from old_pos to new_pos ([n] ints), in place: keys
    [layers, blocks, block_size, kv_heads, head_dim] int8 or float8_e4m3fn (a pool's K planes), scales
    [layers, blocks, block_size, kv_heads] (int8) or [layers, blocks, kv_heads] (fp8); inv_freq [layers,
    head_dim / 2], row i layer i's; shift: None, or [layers, kv_heads, head_dim] (before RoPE) to add at new_pos.
    Everything on one device."""
    n = slots.shape[0]
    if n == 0:
        return
    layers, _, block_size, kv_heads, head_dim = keys.shape
    if head_dim % 2 or inv_freq.shape != (layers, head_dim // 2):
        raise ValueError(f"inv_freq must be [{layers}, {head_dim // 2}], got {tuple(inv_freq.shape)}")
    if keys.stride(-1) != 1 or keys.stride(1) != block_size * keys.stride(2):
        raise ValueError("the pool's slots must be [blocks * block_size] rows with the head dim innermost")
    freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
    half, block_d = head_dim // 2, triton.next_power_of_2(head_dim)
    old_pos, new_pos = old_pos.contiguous(), new_pos.contiguous()
    if shift is not None and shift.shape != (layers, kv_heads, head_dim):
        raise ValueError(f"shift must be [{layers}, {kv_heads}, {head_dim}], got {tuple(shift.shape)}")
    shifts = freq if shift is None else shift.to(device=keys.device, dtype=torch.float32).contiguous()
    if keys.dtype == FP8:
        sorted_slots, order = torch.sort(slots)
        _rerope_fp8_blocks[(n, kv_heads, layers)](
            keys.view(torch.uint8), scales, sorted_slots, order, old_pos, new_pos, freq, shifts, n,
            keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
            scales.stride(0), scales.stride(1), scales.stride(2),
            NUM_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK_SIZE=block_size,
            BLOCK_S=triton.next_power_of_2(block_size), BLOCK_D=block_d, MATCH_FP32=match_fp32_angles,
            SHIFTED=shift is not None)
        return
    if keys.dtype != torch.int8:
        raise TypeError(f"an 8-bit pool's keys are int8 or float8_e4m3fn, got {keys.dtype}")
    if scales.stride(1) != block_size * scales.stride(2):
        raise ValueError("an int8 pool's scales must be [blocks * block_size] rows of slots")
    block_h = triton.next_power_of_2(kv_heads)
    block_t = max(1, min(64, 4096 // (block_h * block_d)))
    _rerope_int8[(triton.cdiv(n, block_t), layers)](
        keys, scales, slots.contiguous(), old_pos, new_pos, freq, shifts, n,
        keys.stride(0), keys.stride(2), keys.stride(3), scales.stride(0), scales.stride(2), scales.stride(3),
        NUM_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        MATCH_FP32=match_fp32_angles, SHIFTED=shift is not None)
