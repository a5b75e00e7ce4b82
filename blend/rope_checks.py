"""The arguments of re-RoPE checked before a key moves (shapes, dtypes, devices, slot bounds): one set of checks
for both backends, the torch one (blend/rope.py) and the Triton kernel (blend/rope_triton.py), which rope.py
dispatches to."""

from __future__ import annotations

import torch


def check_inv_freq(inv_freq: torch.Tensor, head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must have shape ({head_dim // 2},), got {tuple(inv_freq.shape)}")


def check_paged_args(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """Shape/dtype/device checks shared by both backends (no device sync)."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, kvh, hd], got {tuple(k_cache.shape)}")
    if not k_cache.is_floating_point():
        raise TypeError(f"k_cache must be a float tensor, got {k_cache.dtype}")
    num_blocks, block_size, _, hd = k_cache.shape
    check_inv_freq(inv_freq, hd)
    if k_cache.stride(0) != block_size * k_cache.stride(1):
        raise ValueError("k_cache's block and offset dims must be mergeable into one slot dim")
    n = slots.shape[0]
    for name, t in (("slots", slots), ("old_pos", old_pos), ("new_pos", new_pos)):
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be 1-D of length {n}, got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32/int64, got {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, k_cache on {k_cache.device}")
    if inv_freq.device != k_cache.device:
        raise ValueError(f"inv_freq is on {inv_freq.device}, k_cache on {k_cache.device}")
    # Bounds are checked only where it costs no device sync.
    if n and slots.device.type == "cpu":
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_blocks * block_size:
            raise IndexError(f"slots out of range [0, {num_blocks * block_size}): min {lo}, max {hi}")
