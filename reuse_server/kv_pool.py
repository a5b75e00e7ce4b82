"""The paged KV cache: per layer, one K and one V tensor of fixed-size blocks, allocated once.

A token's KV lives at a *slot*: slot = block_id * block_size + offset. A sequence owns an ordered list of
block ids (its block table); position p of that sequence lives in block_table[p // block_size] at offset
p % block_size. K is stored after RoPE. Which blocks belong to whom is decided elsewhere (radix/, scheduler);
this class only stores and moves tensors."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks=} {block_size=}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: the memory is committed now, so the footprint is known at start-up.
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @classmethod
    def from_memory(
        cls,
        memory_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "KVPool":
        """As many blocks as fit in memory_bytes."""
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"{memory_bytes} bytes hold no KV block (one block takes {per_block} bytes)")
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def _flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, kv_heads, head_dim] at slots [T]."""
        k_flat, v_flat = self._flat(layer)
        slot_mapping = slot_mapping.to(self.device, non_blocking=True)
        k_flat.index_copy_(0, slot_mapping, k.to(self.dtype))
        v_flat.index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer: int, block_table: torch.Tensor, length: int,
               first_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions 0..length-1 of the sequence owning block_table: [length, kv_heads, head_dim] each.
        first_block: the table's blocks for those positions are first_block, first_block + 1, ... (see
        consecutive_start); the result is then a read-only view of the pool instead of a copy."""
        num = -(-length // self.block_size)
        if num > len(block_table):
            raise ValueError(f"length {length} needs {num} blocks, the block table has {len(block_table)}")
        shape = (num * self.block_size, self.num_kv_heads, self.head_dim)
        if first_block is not None:
            end = first_block + num
            return self.k[layer][first_block:end].view(shape)[:length], self.v[layer][first_block:end].view(shape)[:length]
        blocks = block_table[:num].to(self.device, non_blocking=True)
        k = self.k[layer].index_select(0, blocks).view(shape)[:length]
        v = self.v[layer].index_select(0, blocks).view(shape)[:length]
        return k, v

    def consecutive_start(self, block_table: torch.Tensor, length: int) -> int | None:
        """The first block id if the blocks holding positions 0..length-1 are consecutive ids, else None.
        A fresh pool hands out consecutive ids, so a long prompt's blocks often are."""
        first, blocks = self.leading_run(block_table, length)
        return first if blocks and blocks == -(-length // self.block_size) else None

    def leading_run(self, block_table: torch.Tensor, length: int) -> tuple[int, int]:
        """(first block id, count) of the consecutive ids that begin the blocks holding positions 0..length-1."""
        num = -(-length // self.block_size)
        blocks = block_table[:num]
        if num == 0:
            return 0, 0
        breaks = torch.nonzero(blocks[1:] - blocks[:-1] != 1)
        return int(blocks[0]), (int(breaks[0]) + 1 if breaks.numel() else num)

    def read_slots(self, layer: int, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V stored at the given slots: [T, kv_heads, head_dim] each (copies)."""
        k_flat, v_flat = self._flat(layer)
        slot_mapping = slot_mapping.to(self.device, non_blocking=True)
        return k_flat.index_select(0, slot_mapping), v_flat.index_select(0, slot_mapping)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared partial block)."""
        for layer in range(self.num_layers):
            self.k[layer][dst] = self.k[layer][src]
            self.v[layer][dst] = self.v[layer][src]
