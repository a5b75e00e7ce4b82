"""Key shift: the systematic part of how a chunk's cached keys differ from the keys it has in a new context.

A chunk cached alone (right after the prompt's opening) and reused after other text keeps keys computed as if
nothing preceded it. The difference, taken before RoPE, has a large common component: the mean difference over
many chunks, contexts and positions points the same way in every layer and removes much of the deviation of
held-out chunks (measured on SmolLM2: benchmarks/results/history.md). Adding that mean to the reused keys
shifts every query's logits on the chunk by q·shift: it restores how much attention the stale chunk gets as a
whole, which is what stale distractor passages get wrong. Values have no such common part, and correcting them
lowered accuracy, so only keys are shifted.

The shift is estimated once per model (`KeyShiftEstimate`, fed by a calibration pass over plain prose) and
added to the keys of every chunk reused from its alone form, at the chunk's new positions (`KeyShift.apply_`).
Everything here takes the model's inverse frequencies as blend/rope.py does: one [d/2] vector for every layer, or a
[layers, d/2] table whose row i is layer i's (Gemma 3 un-rotates and rotates its sliding layers with base 10k, its
global ones with 1M).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blend.rope import _rotate, apply_rope, layer_inv_freq, per_layer_cos_sin, rerope_layers_


def unrope(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [N, heads, d] with their RoPE at positions [N] undone (a rotation by minus the same fp32 angle)."""
    return apply_rope(k.float(), -positions.to(torch.int64), inv_freq)


@dataclass(frozen=True)
class KeyShift:
    k: torch.Tensor  # [layers, kv_heads, head_dim], fp32, before RoPE

    def apply_(self, k_caches: list[torch.Tensor] | tuple[torch.Tensor, ...], slots: torch.Tensor,
               positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
        """Add the shift, rotated to `positions` [N], to the keys at `slots` [N] of every layer's paged pool
        ([num_blocks, block_size, kv_heads, head_dim] each). Slots must be distinct. inv_freq: [d/2] or
        [layers, d/2] (each layer rotated with its own)."""
        if len(k_caches) != self.k.shape[0]:
            raise ValueError(f"the shift has {self.k.shape[0]} layers, the pool {len(k_caches)}")
        if slots.numel() == 0:
            return
        device = k_caches[0].device
        idx = slots.to(device=device, dtype=torch.int64)
        pos = positions.to(device=device, dtype=torch.int64)
        # the rotation to each position, once per distinct RoPE (from 0: the model's own fp32 angles)
        cos_sins = per_layer_cos_sin(torch.zeros_like(pos), pos, inv_freq.to(device), len(k_caches))
        shift = self.k.to(device)
        for layer, (k_cache, cos_sin) in enumerate(zip(k_caches, cos_sins)):
            _, _, kv_heads, hd = k_cache.shape
            rotated = _rotate(shift[layer].expand(len(idx), kv_heads, hd), cos_sin=cos_sin)
            k_cache.view(-1, kv_heads, hd).index_add_(0, idx, rotated.to(k_cache.dtype))

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"k": self.k.contiguous()}

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> "KeyShift":
        return cls(tensors["k"].float())


class KeyShiftEstimate:
    """The mean, over every token seen, of (key in context) - (key alone), both un-rotated, per layer."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, inv_freq: torch.Tensor) -> None:
        self.sum = torch.zeros(num_layers, kv_heads, head_dim, dtype=torch.float64)
        self.tokens = 0
        self.inv_freq = layer_inv_freq(inv_freq.float().cpu(), num_layers)  # [layers, d/2]

    def add(self, in_context: list[torch.Tensor], context_pos: torch.Tensor,
            alone: list[torch.Tensor], alone_pos: torch.Tensor) -> None:
        """One chunk: per layer, its post-RoPE keys [n, kv_heads, d] computed after other text (at context_pos)
        and computed alone after the opening (at alone_pos)."""
        if len(in_context) != self.sum.shape[0] or len(alone) != self.sum.shape[0]:
            raise ValueError("one key tensor per layer is needed")
        for layer, (k_ctx, k_alone) in enumerate(zip(in_context, alone)):
            f = self.inv_freq[layer]
            diff = unrope(k_ctx.cpu(), context_pos.cpu(), f) - unrope(k_alone.cpu(), alone_pos.cpu(), f)
            self.sum[layer] += diff.double().sum(0)
        self.tokens += len(context_pos)

    def result(self) -> KeyShift:
        if not self.tokens:
            raise ValueError("no tokens were added")
        return KeyShift((self.sum / self.tokens).float())


@dataclass(frozen=True)
class KeyMove:
    """The key edit a reused chunk needs where it now sits, as the KV pool's `update_keys` takes it
    (`change(k_caches, slots)`): re-rotate from old_positions to new_positions and, with a shift, add it at
    new_positions, in one pass, so an 8-bit pool requantizes the moved keys once for both. inv_freq: [d/2] for
    every layer or [layers, d/2], each layer's own."""
    old_positions: torch.Tensor
    new_positions: torch.Tensor
    inv_freq: torch.Tensor
    shift: KeyShift | None = None

    @property
    def in_place(self) -> "KeyMove":
        """This edit as data, for a pool that applies it to its keys in place itself (an 8-bit pool through its
        Triton kernel) instead of calling it on copies: the positions, `inv_freq_table` and `shift_table`."""
        return self

    def shift_table(self) -> torch.Tensor | None:
        """The shift per layer before RoPE, [layers, kv_heads, head_dim] (None: no shift)."""
        return None if self.shift is None else self.shift.k

    def inv_freq_table(self, num_layers: int) -> torch.Tensor:
        """inv_freq as [num_layers, d/2], row i layer i's."""
        return layer_inv_freq(self.inv_freq, num_layers)

    def of_layers(self, layers: list[int], num_layers: int) -> "KeyMove":
        """The same edit for a pool holding only `layers` of the model's num_layers (a hybrid model's two)."""
        shift = None if self.shift is None else KeyShift(self.shift.k[layers])
        return KeyMove(self.old_positions, self.new_positions, self.inv_freq_table(num_layers)[layers], shift)

    def __call__(self, k_caches, slots: torch.Tensor) -> None:
        # The caller (the Blender) counts positions on the host; the pool hands slots on its own device, where
        # the rotation runs: the positions go over there, once for both edits.
        old, new = self.old_positions.to(slots.device), self.new_positions.to(slots.device)
        rerope_layers_(k_caches, slots, old, new, self.inv_freq.to(slots.device))
        if self.shift is not None:
            self.shift.apply_(k_caches, slots, new, self.inv_freq)


def moved_keys(old_positions: torch.Tensor, new_positions: torch.Tensor, inv_freq: torch.Tensor,
               shift: KeyShift | None = None) -> KeyMove:
    """The KeyMove from old_positions to new_positions (with `shift` added there, if given)."""
    return KeyMove(old_positions, new_positions, inv_freq, shift)
