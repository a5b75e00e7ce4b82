"""The paged KV pool: every token's K and V, in fixed-size blocks, in one allocation. The only code that
touches KV memory: the model writes through it, attention reads through it, blending moves, re-rotates and
shifts keys through it, and tiers export and import whole blocks through it.

A token's KV lives at a *slot*: slot = block_id * block_size + offset. A sequence owns an ordered list of
block ids (its block table); position p of that sequence lives in block_table[p // block_size] at offset
p % block_size. K is stored after RoPE. Which blocks belong to whom is decided elsewhere (radix/, the block
manager); this class only stores and moves tensors.

Layout: one tensor [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]. Each layer's K (and V) is then
one contiguous [blocks, block_size, kv_heads, head_dim] array, which is what the attention kernels read in
place through a block table; one block's KV of every layer is `data[:, :, block]`, which export and import
move in one strided copy, so a tier gets a block as one contiguous buffer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from blend import rerope_layers_

K, V = 0, 1


@dataclass(frozen=True)
class BlockLayout:
    """What an exported block buffer holds: [layers, 2 (K, V), block_size, kv_heads, head_dim] of `dtype`,
    K after RoPE at the block's own positions, as `nbytes` bytes."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> dict:
        """The layout as plain data, for a tier's self-describing files."""
        return {"order": "layer,kv,token,head,dim", "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch.")}


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
        self.layout = BlockLayout(num_layers, block_size, num_kv_heads, head_dim, dtype)
        # zeros, not empty: the memory is committed now, so the footprint is known at start-up.
        self._data = torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype,
                                 device=self.device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return BlockLayout(num_layers, block_size, num_kv_heads, head_dim, dtype).nbytes

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

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    def _flat(self, layer: int, kind: int) -> torch.Tensor:
        return self._data[layer, kind].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.to(self.device, non_blocking=True)

    # ---- reads for attention ---------------------------------------------------------------
    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's K and V as [blocks, block_size, kv_heads, head_dim] each: views the attention kernels read
        in place through a block table. Read-only: write through `write`."""
        return self._data[layer, K], self._data[layer, V]

    def gather(self, layer: int, block_table: torch.Tensor, length: int,
               first_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions 0..length-1 of the sequence owning block_table: [length, kv_heads, head_dim] each.
        first_block: the table's blocks for those positions are first_block, first_block + 1, ... (see
        consecutive_start); the result is then a read-only view of the pool instead of a copy."""
        num = -(-length // self.block_size)
        if num > len(block_table):
            raise ValueError(f"length {length} needs {num} blocks, the block table has {len(block_table)}")
        if first_block is not None:
            k, v = self.run(layer, first_block, num)
            return k[:length], v[:length]
        blocks = block_table[:num].to(self.device, non_blocking=True)
        shape = (num * self.block_size, self.num_kv_heads, self.head_dim)
        k = self._data[layer, K].index_select(0, blocks).view(shape)[:length]
        v = self._data[layer, V].index_select(0, blocks).view(shape)[:length]
        return k, v

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks (ids [n]): [n, block_size, kv_heads, head_dim] each (copies)."""
        blocks = blocks.to(self.device, non_blocking=True)
        return self._data[layer, K].index_select(0, blocks), self._data[layer, V].index_select(0, blocks)

    def run(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the consecutive blocks first_block .. first_block + num_blocks - 1 as [num_blocks *
        block_size, kv_heads, head_dim] read-only views (no copy)."""
        shape = (num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        end = first_block + num_blocks
        return self._data[layer, K, first_block:end].view(shape), self._data[layer, V, first_block:end].view(shape)

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

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V stored at the given slots: [T, kv_heads, head_dim] each (copies)."""
        slots = self._slots(slots)
        return self._flat(layer, K).index_select(0, slots), self._flat(layer, V).index_select(0, slots)

    def read_keys(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's keys at the given slots: per layer [T, kv_heads, head_dim] (copies)."""
        slots = self._slots(slots)
        return [self._flat(layer, K).index_select(0, slots) for layer in range(self.num_layers)]

    # ---- writes ----------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, kv_heads, head_dim] at slots [T]."""
        slots = self._slots(slots)
        self._flat(layer, K).index_copy_(0, slots, k.to(self.dtype))
        self._flat(layer, V).index_copy_(0, slots, v.to(self.dtype))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared partial block)."""
        if src:
            src_t = torch.tensor(src, device=self.device)
            self._data[:, :, torch.tensor(dst, device=self.device)] = self._data[:, :, src_t]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots src[i] -> dst[i] in every layer (distinct dst)."""
        src, dst = self._slots(src), self._slots(dst)
        flat = self._data.view(self.num_layers, 2, self.num_slots, self.num_kv_heads, self.head_dim)
        flat[:, :, dst] = flat[:, :, src]

    def rerope(self, slots: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
               inv_freq: torch.Tensor) -> None:
        """Rotate the keys at slots (every layer) from old_positions to new_positions, in place."""
        rerope_layers_(self._keys_by_layer(), self._slots(slots), old_positions, new_positions, inv_freq)

    def shift_keys(self, shift, slots: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
        """Add a KeyShift (blend.key_shift), rotated to positions, to the keys at slots of every layer."""
        shift.apply_(self._keys_by_layer(), self._slots(slots), positions, inv_freq)

    def _keys_by_layer(self) -> list[torch.Tensor]:
        return [self._data[layer, K] for layer in range(self.num_layers)]

    # ---- whole blocks, for tiers -----------------------------------------------------------
    def export_blocks(self, blocks: list[int]) -> torch.Tensor:
        """The KV of whole blocks, every layer, as bytes: uint8 [n, layout.nbytes], contiguous, on the CPU;
        row i is block i's buffer, laid out as `layout` describes."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        data = self._data[:, :, ids].permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        return data.view(len(blocks), -1).view(torch.uint8)

    def import_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write block buffers made by export_blocks (uint8 [n, layout.nbytes], any device) into the given
        blocks."""
        if data.dtype != torch.uint8 or tuple(data.shape) != (len(blocks), self.layout.nbytes):
            raise ValueError(f"expected uint8 [{len(blocks)}, {self.layout.nbytes}] block buffers, got "
                             f"{data.dtype} {tuple(data.shape)}")
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        values = data.to(self.device).contiguous().view(self.dtype).view(len(blocks), *self.layout.shape)
        self._data[:, :, ids] = values.permute(1, 2, 0, 3, 4, 5)
