"""Triton kernel for in-place re-RoPE of post-RoPE keys in the paged KV pool.

Same contract and numerics as :func:`blend.rope.rerope_torch_`: each program handles
BLOCK_T tokens x all kv heads; the rotation angle of pair i is fl32(q*f_i) - fl32(p*f_i)
(the model's own float32 angle rounding, see blend/rope.py), the subtraction and the
reduction to [-pi, pi) are done in float64, then cos/sin and the rotation in float32.
Importing this module imports triton; ``TRITON_INTERPRET=1`` must be in the environment
before that import to run the kernel on CPU tensors (the interpreter). One call moves one
layer's pool with that layer's inv_freq; :func:`blend.rope.rerope_layers_` hands each layer its
own row of a per-layer table (Gemma 3's sliding and global layers differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blend.rope_checks import check_paged_args

_TWO_PI = 6.283185307179586


@triton.jit
def rotation_cos_sin(p_old, p_new, f, MATCH_FP32: tl.constexpr):
    """float32 cos and sin of the angles that move a key from p_old to p_new (int64) for inverse frequencies
    f (float32), broadcast against each other: fl32(p_new*f) - fl32(p_old*f) in float64 (MATCH_FP32, the
    model's own angle rounding) or (p_new - p_old)*f in float64, reduced to [-pi, pi) before float32. Shared by
    every kernel that re-rotates keys (this module's, and the 8-bit pools' in reuse_server/kv/triton_rerope.py)."""
    if MATCH_FP32:
        a_new = p_new.to(tl.float32) * f
        a_old = p_old.to(tl.float32) * f
        ang = a_new.to(tl.float64) - a_old.to(tl.float64)
    else:
        ang = (p_new - p_old).to(tl.float64) * f.to(tl.float64)
    ang = ang - _TWO_PI * tl.floor(ang / _TWO_PI + 0.5)
    ang32 = ang.to(tl.float32)
    return tl.cos(ang32), tl.sin(ang32)


@triton.jit
def _rerope_kernel(
    k_ptr,
    slots_ptr,
    old_pos_ptr,
    new_pos_ptr,
    inv_freq_ptr,
    n_tokens,
    stride_slot,
    stride_head,
    stride_dim,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MATCH_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    # One row per (token, head) pair of this program's BLOCK_T tokens.
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = pid * BLOCK_T + rows // BLOCK_H
    head = rows % BLOCK_H
    tok_ok = tok < n_tokens
    row_ok = tok_ok & (head < NUM_HEADS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF

    slot = tl.load(slots_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    p_old = tl.load(old_pos_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    p_new = tl.load(new_pos_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    f = tl.load(inv_freq_ptr + d, mask=d_ok, other=0.0).to(tl.float32)

    cos, sin = rotation_cos_sin(p_old[:, None], p_new[:, None], f[None, :], MATCH_FP32)

    mask = row_ok[:, None] & d_ok[None, :]
    ptr1 = k_ptr + slot[:, None] * stride_slot + head.to(tl.int64)[:, None] * stride_head + d[None, :] * stride_dim
    ptr2 = ptr1 + HALF * stride_dim
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    out_ty = k_ptr.dtype.element_ty
    tl.store(ptr1, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(ptr2, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


def _block_tokens(num_heads_p2: int, block_d: int) -> int:
    # Aim for ~4k elements per half-tile per program; at least one token.
    return max(1, min(64, 4096 // (num_heads_p2 * block_d)))


def rerope_triton_(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    match_fp32_angles: bool = True,
) -> None:
    """Triton implementation of :func:`blend.rope.rerope_` (same arguments, in place; inv_freq [hd/2] is
    this layer's)."""
    check_paged_args(k_cache, slots, old_pos, new_pos, inv_freq)
    n = slots.shape[0]
    if n == 0:
        return
    _, _, kvh, hd = k_cache.shape
    half = hd // 2
    block_h = triton.next_power_of_2(kvh)
    block_d = triton.next_power_of_2(half)
    block_t = _block_tokens(block_h, block_d)
    grid = (triton.cdiv(n, block_t),)
    _rerope_kernel[grid](
        k_cache,
        slots.contiguous(),
        old_pos.contiguous(),
        new_pos.contiguous(),
        inv_freq.to(torch.float32).contiguous(),
        n,
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        NUM_HEADS=kvh,
        HALF=half,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        MATCH_FP32=match_fp32_angles,
    )
