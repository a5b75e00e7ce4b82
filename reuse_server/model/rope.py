"""Rotary position embedding in the layout transformers' Llama uses ("neox" style: the head dim is split
into two halves that are rotated against each other, see `rotate_half`). K in the KV pool is stored after
this rotation, so anything that moves cached K to another position (blending's re-RoPE) must use the same
convention: moving K from position a to b is apply_rotary(k, *cos_sin(b - a)) (up to rounding)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


def inverse_frequencies(config: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """fp32 [head_dim // 2], computed as transformers computes it (bit-for-bit on the CPU). With `theta`: plain
    RoPE of that base (Gemma 3's sliding layers), else the config's base and scaling. Always computed on the CPU,
    also while the model is built under `torch.device("meta")`: arithmetic on meta tensors runs torch's Python
    reference ops, whose first use imports torch._dynamo (with sympy and triton), resident for the server's life."""
    dim = config.head_dim
    base = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling if theta is None else None
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (as returned by RotaryEmbedding.cos_sin)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None = None, theta: float | None = None):
        """The config's RoPE (base and scaling), or with `theta` plain RoPE of that base."""
        super().__init__()
        self.config, self.local_theta = config, theta
        self.theta = config.rope_theta if theta is None else theta  # the base: names its cos/sin in a step's cache
        self.register_buffer("inv_freq", inverse_frequencies(config, theta).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, head_dim] for integer (or, for re-RoPE deltas, any-sign) positions [T].
        Angles are computed in fp32 and cast to `dtype` afterwards, as transformers does."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [positions, head_dim] of positions 0 .. positions - 1, computed once: row p is
        cos_sin of p alone, bit for bit (torch's vectorized cos and sin do not depend on where an element sits)."""
        return self.cos_sin(torch.arange(positions), torch.float32)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_sin(positions, dtype)

    def reset(self, device: torch.device | str) -> None:
        """Recompute inv_freq on `device` (after the model was built on the meta device)."""
        self.inv_freq = inverse_frequencies(self.config, self.local_theta).to(device)
