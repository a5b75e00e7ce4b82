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
move in one strided copy, so a tier gets a block as one contiguous buffer.

Storage dtype (kv_quant.py has the formats): fp32, fp16 or bf16 store K and V as they are; fp8_e4m3 and int8
store 8-bit values plus fp32 scales, one per (layer, K/V, block, KV head) for fp8 ([layers, 2, blocks, heads])
and one per (layer, K/V, slot, KV head) for int8 ([layers, 2, blocks, block_size, heads]). Every write
quantizes; every read for torch's attention (read, gather, gather_blocks, run) returns dequantized copies in
`read_dtype`; the CPU kernel reads the 8-bit values and their scales in place (layer_blocks, layer_scales).
An fp8 block's scale covers all of its tokens, so a write into a block that already holds tokens (decode
appends one at a time, blending recomputes some of a block's tokens) rewrites the whole block at the scale
its old and new tokens need together; blocks handed to a new owner are cleared first (clear_blocks), so that
a block's scale never depends on a previous owner's tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from blend import rerope_layers_

from reuse_server.kv import layout as kv_layout, quant as kv_quant

K, V = 0, 1


@dataclass(frozen=True)
class BlockLayout:
    """What an exported block buffer holds, as `nbytes` bytes: the values, [layers, 2 (K, V), block_size,
    kv_heads, head_dim] of `dtype`, K after RoPE at the block's own positions; then, for the 8-bit dtypes,
    their fp32 scales: [layers, 2, kv_heads] for fp8 (one per block), [layers, 2, block_size, kv_heads] for
    int8 (one per token). A value is stored * scale. `nbytes` equals kv_layout's bytes per block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        per = kv_quant.scale_per(self.dtype)
        if per is None:
            return None
        tokens = (self.block_size,) if per == "token" else ()
        return (self.num_layers, 2, *tokens, self.num_kv_heads)

    @property
    def data_nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def scale_nbytes(self) -> int:
        return 0 if self.scale_shape is None else _numel(self.scale_shape) * kv_layout.SCALE_BYTES

    @property
    def nbytes(self) -> int:
        return self.data_nbytes + self.scale_nbytes

    def with_dtype(self, dtype: "torch.dtype | str") -> "BlockLayout":
        """The same blocks stored in another KV dtype (a torch dtype or a kv_layout name)."""
        return BlockLayout(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                           kv_quant.storage_dtype(dtype))

    def describe(self) -> dict:
        """The layout as plain data, for a tier's self-describing files (from_description reads it back)."""
        sections = [{"name": "values", "offset": 0, "nbytes": self.data_nbytes, "order": "layer,kv,token,head,dim",
                     "shape": list(self.shape), "dtype": _name(self.dtype)}]
        if self.scale_shape is not None:
            per = kv_quant.scale_per(self.dtype)
            sections.append({"name": "scales", "offset": self.data_nbytes, "nbytes": self.scale_nbytes,
                             "order": "layer,kv,token,head" if per == "token" else "layer,kv,head",
                             "shape": list(self.scale_shape), "dtype": "float32", "per": per,
                             "value": "stored * scale"})
        return {"order": "layer,kv,token,head,dim", "shape": list(self.shape), "dtype": _name(self.dtype),
                "kv_dtype": kv_quant.spec(self.dtype).name, "nbytes": self.nbytes, "sections": sections}

    @classmethod
    def from_description(cls, description: dict) -> "BlockLayout":
        layers, _, block_size, heads, head_dim = description["shape"]
        layout = cls(layers, block_size, heads, head_dim, kv_quant.storage_dtype(description["kv_dtype"]))
        if layout.describe() != description:
            raise ValueError(f"not a block layout this version writes: {description}")
        return layout

    def split(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block buffers uint8 [n, nbytes] -> (values [n, *shape] of dtype, scales [n, *scale_shape] fp32 or
        None); views where the bytes allow."""
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != self.nbytes:
            raise ValueError(f"expected uint8 [n, {self.nbytes}] block buffers, got {data.dtype} {tuple(data.shape)}")
        n = data.shape[0]
        values = data[:, :self.data_nbytes].view(self.dtype).view(n, *self.shape)
        if self.scale_shape is None:
            return values, None
        scales = data[:, self.data_nbytes:].contiguous().view(torch.float32).view(n, *self.scale_shape)
        return values, scales

    def join(self, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """The inverse of split: uint8 [n, nbytes], contiguous."""
        n = values.shape[0]
        parts = [values.contiguous().view(torch.uint8).view(n, -1)]
        if scales is not None:
            parts.append(scales.to(torch.float32).contiguous().view(torch.uint8).view(n, -1))
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()

    def decode(self, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Block buffers -> their K/V values [n, *shape] in `dtype` (dequantized)."""
        return kv_quant.dequantize_blocks(*self.split(data), dtype)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """K/V values [n, *shape] (any float dtype) -> block buffers in this layout (fresh scales)."""
        return self.join(*kv_quant.quantize_blocks(values, self.dtype))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: "torch.dtype | str" = torch.float32,
        device: torch.device | str = "cpu",
        read_dtype: torch.dtype = torch.float32,
        native_store: bool = True,
    ):
        """dtype: the storage dtype, a torch dtype (torch.float8_e4m3fn and torch.int8 are the 8-bit formats
        with their scales) or a kv_layout name ('fp8_e4m3', 'int8', ...). read_dtype: what reads of an 8-bit
        pool dequantize into (the model's compute dtype); the other pools read back their own dtype.
        native_store: an 8-bit pool on the CPU quantizes its writes through the C++ kernel where it can be
        built (False: torch's ops, the same arithmetic)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks=} {block_size=}")
        dtype = kv_quant.storage_dtype(dtype)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.scale_per = kv_quant.scale_per(dtype)  # None, "block" (fp8) or "token" (int8)
        self.quantized = self.scale_per is not None
        self.read_dtype = read_dtype if self.quantized else dtype
        self.device = torch.device(device)
        self.layout = BlockLayout(num_layers, block_size, num_kv_heads, head_dim, dtype)
        # zeros, not empty: the memory is committed now, so the footprint is known at start-up.
        self._data = torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype,
                                 device=self.device)
        self._scales = None
        self._native_store = None
        if self.quantized and native_store and self.device.type == "cpu":
            from reuse_server.model import cpu_kv_store

            self._native_store = cpu_kv_store.load()
        if self.quantized:
            tokens = (block_size,) if self.scale_per == "token" else ()
            self._scales = torch.zeros((num_layers, 2, num_blocks, *tokens, num_kv_heads), dtype=torch.float32,
                                       device=self.device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: "torch.dtype | str") -> int:
        """kv_layout's formula (scales included), which `reuse-server kv-calc` shows too."""
        geometry = kv_layout.KVGeometry.uniform(num_layers, num_kv_heads, head_dim)
        return kv_layout.bytes_per_block(geometry, kv_quant.spec(kv_quant.storage_dtype(dtype)), block_size)

    @classmethod
    def from_memory(
        cls,
        memory_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: "torch.dtype | str" = torch.float32,
        device: torch.device | str = "cpu",
        read_dtype: torch.dtype = torch.float32,
    ) -> "KVPool":
        """As many blocks as fit in memory_bytes."""
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"{memory_bytes} bytes hold no KV block (one block takes {per_block} bytes)")
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, read_dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        scales = 0 if self._scales is None else self._scales.numel() * self._scales.element_size()
        return self._data.numel() * self._data.element_size() + scales

    @property
    def bytes_per_token(self) -> float:
        return self.layout.nbytes / self.block_size

    def _flat(self, layer: int, kind: int) -> torch.Tensor:
        return self._data[layer, kind].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.to(self.device, non_blocking=True)

    # ---- reads for attention ---------------------------------------------------------------
    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's K and V as stored, [blocks, block_size, kv_heads, head_dim] each: views the attention
        kernels read in place through a block table (with layer_scales for the 8-bit dtypes). Read-only:
        write through `write`."""
        return self._data[layer, K], self._data[layer, V]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer's K and V scales in place: [blocks, kv_heads] each for fp8, [blocks, block_size, kv_heads]
        for int8; (None, None) for the plain dtypes."""
        if self._scales is None:
            return None, None
        return self._scales[layer, K], self._scales[layer, V]

    def gather(self, layer: int, block_table: torch.Tensor, length: int,
               first_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions 0..length-1 of the sequence owning block_table: [length, kv_heads, head_dim] each.
        first_block: the table's blocks for those positions are first_block, first_block + 1, ... (see
        consecutive_start); the result is then a read-only view of the pool instead of a copy (a plain
        dtype's pool; an 8-bit pool always returns dequantized copies)."""
        num = -(-length // self.block_size)
        if num > len(block_table):
            raise ValueError(f"length {length} needs {num} blocks, the block table has {len(block_table)}")
        if first_block is not None:
            k, v = self.run(layer, first_block, num)
            return k[:length], v[:length]
        shape = (num * self.block_size, self.num_kv_heads, self.head_dim)
        k, v = self.gather_blocks(layer, block_table[:num])
        return k.view(shape)[:length], v.view(shape)[:length]

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks (ids [n]): [n, block_size, kv_heads, head_dim] each (copies)."""
        blocks = blocks.to(self.device, non_blocking=True)
        k = self._data[layer, K].index_select(0, blocks)
        v = self._data[layer, V].index_select(0, blocks)
        if not self.quantized:
            return k, v
        ks, vs = (s.index_select(0, blocks) for s in self.layer_scales(layer))
        return (kv_quant.dequantize_blocks(k, ks, self.read_dtype),
                kv_quant.dequantize_blocks(v, vs, self.read_dtype))

    def run(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the consecutive blocks first_block .. first_block + num_blocks - 1 as [num_blocks *
        block_size, kv_heads, head_dim]: read-only views (no copy) of a plain dtype's pool, dequantized
        copies of an 8-bit one."""
        shape = (num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        end = first_block + num_blocks
        k, v = self._data[layer, K, first_block:end], self._data[layer, V, first_block:end]
        if self.quantized:
            ks, vs = (s[first_block:end] for s in self.layer_scales(layer))
            k = kv_quant.dequantize_blocks(k, ks, self.read_dtype)
            v = kv_quant.dequantize_blocks(v, vs, self.read_dtype)
        return k.view(shape), v.view(shape)

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
        if self.quantized:
            k, v = self._read_planes(self._data[layer], self._scales[layer], slots, self.read_dtype)
            return k, v
        return self._flat(layer, K).index_select(0, slots), self._flat(layer, V).index_select(0, slots)

    def read_keys(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's keys at the given slots: per layer [T, kv_heads, head_dim] (copies)."""
        slots = self._slots(slots)
        if self.quantized:
            return list(self._read_planes(self._data[:, K], self._scales[:, K], slots, self.read_dtype))
        return [self._flat(layer, K).index_select(0, slots) for layer in range(self.num_layers)]

    # ---- writes ----------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, kv_heads, head_dim] at slots [T] (distinct), quantized to the pool's dtype."""
        slots = self._slots(slots)
        if self.quantized:
            self._store_planes(self._data[layer], self._scales[layer], slots, torch.stack([k, v]))
            return
        self._flat(layer, K).index_copy_(0, slots, k.to(self.dtype))
        self._flat(layer, V).index_copy_(0, slots, v.to(self.dtype))

    def clear_blocks(self, blocks: list[int]) -> None:
        """Blocks handed to a new owner: forget what they held. Only fp8 needs it (a block's scale covers
        every token in it, and must not carry a previous owner's range); a no-op for the other dtypes."""
        if self.scale_per != "block" or not blocks:
            return
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self._data.view(torch.uint8)[:, :, ids] = 0
        self._scales[:, :, ids] = 0

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared partial block),
        with their scales."""
        if src:
            src_t = torch.tensor(src, device=self.device)
            dst_t = torch.tensor(dst, device=self.device)
            self._data[:, :, dst_t] = self._data[:, :, src_t]
            if self._scales is not None:
                self._scales[:, :, dst_t] = self._scales[:, :, src_t]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots src[i] -> dst[i] in every layer (distinct dst). An fp8 pool re-expresses
        the tokens at their destination blocks' scales."""
        src, dst = self._slots(src), self._slots(dst)
        if self.scale_per == "block":
            data = self._data.view(self.num_layers * 2, *self._data.shape[2:])
            scales = self._scales.view(self.num_layers * 2, *self._scales.shape[2:])
            self._store_planes(data, scales, dst, self._read_planes(data, scales, src, torch.float32))
            return
        flat = self._data.view(self.num_layers, 2, self.num_slots, self.num_kv_heads, self.head_dim)
        flat[:, :, dst] = flat[:, :, src]
        if self.scale_per == "token":
            flat_scales = self._scales.view(self.num_layers, 2, self.num_slots, self.num_kv_heads)
            flat_scales[:, :, dst] = flat_scales[:, :, src]

    def rerope(self, slots: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
               inv_freq: torch.Tensor, shift=None) -> None:
        """Rotate the keys at slots (every layer) from old_positions to new_positions, in place; with a
        KeyShift (blend.key_shift), then add it at new_positions (an 8-bit pool requantizes once for both)."""
        def move(caches: list[torch.Tensor], idx: torch.Tensor) -> None:
            rerope_layers_(caches, idx, old_positions, new_positions, inv_freq)
            if shift is not None:
                shift.apply_(caches, idx, new_positions, inv_freq)

        self.update_keys(slots, move)

    def shift_keys(self, shift, slots: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
        """Add a KeyShift (blend.key_shift), rotated to positions, to the keys at slots of every layer."""
        self.update_keys(slots, lambda caches, idx: shift.apply_(caches, idx, positions, inv_freq))

    def update_keys(self, slots: torch.Tensor, change) -> None:
        """change(k_caches, idx) edits, in place, the keys at idx of per-layer paged key caches ([blocks,
        block_size, kv_heads, head_dim] each, as blend's re-RoPE and key shift take them): the pool's own
        for a plain dtype; for an 8-bit pool, dequantized fp32 copies of the keys at slots, which are then
        requantized with fresh scales (an fp8 block at the scale its old and new tokens need together); an fp16
        or bf16 pool also edits fp32 copies, so that a re-RoPE and a shift round the keys once."""
        slots = self._slots(slots)
        if self.dtype == torch.float32:
            change([self._data[layer, K] for layer in range(self.num_layers)], slots)
            return
        if slots.numel() == 0:
            return
        data, scales = self._data[:, K], None if self._scales is None else self._scales[:, K]
        keys = self._read_planes(data, scales, slots, torch.float32)  # [layers, n, heads, dim]
        n = slots.shape[0]
        change([keys[layer].view(n, 1, self.num_kv_heads, self.head_dim) for layer in range(self.num_layers)],
               torch.arange(n, device=self.device))
        self._store_planes(data, scales, slots, keys)

    # ---- storage by planes ------------------------------------------------------------------------
    # A "plane" is one layer's K or V: data [planes, blocks, block_size, heads, dim] and its scales
    # [planes, blocks, heads] (fp8) or [planes, blocks, block_size, heads] (int8) or None, views of the pool.
    def _read_planes(self, data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
        """Dequantized values at slots: [planes, T, heads, dim]."""
        planes = data.shape[0]
        stored = data.reshape(planes, self.num_slots, self.num_kv_heads, self.head_dim)[:, slots]
        if scales is None:
            return stored.to(dtype)
        if self.scale_per == "block":
            scale = scales[:, torch.div(slots, self.block_size, rounding_mode="floor")]
        else:
            scale = scales.reshape(planes, self.num_slots, self.num_kv_heads)[:, slots]
        return kv_quant.dequantize(stored, scale[..., None], dtype)

    def _store_planes(self, data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                      values: torch.Tensor) -> None:
        """Quantize values [planes, T, heads, dim] into slots [T] (distinct) of every plane."""
        planes = data.shape[0]
        if scales is None:
            flat = data.view(planes, self.num_slots, self.num_kv_heads, self.head_dim)
            flat.index_copy_(1, slots, values.to(self.dtype))
            return
        if self._native_store is not None:
            self._native_store.store(data, scales, slots, values)
            return
        if self.scale_per == "token":
            stored, scale = kv_quant.quantize_tokens(values, self.dtype)
            data.view(planes, self.num_slots, self.num_kv_heads, self.head_dim).index_copy_(1, slots, stored)
            scales.view(planes, self.num_slots, self.num_kv_heads).index_copy_(1, slots, scale)
            return
        self._store_fp8(data, scales, slots, values)

    def _store_fp8(self, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """fp8: each block the slots fall in takes the scale its kept tokens (those not written now) and its
        new ones need together; where that changes the scale, the kept tokens are re-expressed at it (exact
        for a power-of-two change, unless a token falls below e4m3's normal range). Decode appends mostly
        fit the block's scale as it is, and a fresh block keeps nothing, so the common writes only quantize
        the new tokens."""
        planes, bs = data.shape[0], self.block_size
        raw = data.view(torch.uint8)
        blocks = torch.div(slots, bs, rounding_mode="floor")
        touched, where = torch.unique(blocks, return_inverse=True)
        old = scales[:, touched]  # [planes, blocks touched, heads]
        kept = raw[:, touched]  # a copy: [planes, blocks touched, block_size, heads, dim]
        kept[:, where, slots - blocks * bs] = 0  # what is written now is not kept
        kept_amax = kv_quant.fp8_magnitude((kept & 0x7F).amax(dim=(2, 4))) * old
        token_amax = values.float().abs().amax(-1)  # [planes, T, heads]
        new_amax = torch.zeros_like(old).scatter_reduce_(1, where[None, :, None].expand_as(token_amax), token_amax,
                                                         "amax")
        scale = kv_quant.fp8_scale(torch.maximum(kept_amax, new_amax))
        moved = ((scale != old) & (kept_amax > 0)).any(-1).any(0).nonzero(as_tuple=True)[0]
        if moved.numel():
            rescaled = kv_quant.dequantize_blocks(kept[:, moved].view(self.dtype), old[:, moved])
            raw[:, touched[moved]] = kv_quant.quantize_fp8(rescaled, scale[:, moved, None, :, None]).view(torch.uint8)
        stored = kv_quant.quantize_fp8(values, scale[:, where, :, None])
        raw.view(planes, self.num_slots, self.num_kv_heads, self.head_dim).index_copy_(1, slots,
                                                                                      stored.view(torch.uint8))
        scales[:, touched] = scale

    # ---- whole blocks, for tiers -----------------------------------------------------------
    def layout_for(self, dtype: "torch.dtype | str | None") -> BlockLayout:
        """The layout of this pool's blocks stored in `dtype` (None: the pool's own)."""
        return self.layout if dtype is None else self.layout.with_dtype(dtype)

    def export_blocks(self, blocks: list[int], as_dtype: "torch.dtype | str | None" = None) -> torch.Tensor:
        """The KV of whole blocks, every layer, as bytes: uint8 [n, layout.nbytes], contiguous, on the CPU;
        row i is block i's buffer, laid out as `layout_for(as_dtype)` describes. as_dtype (a torch dtype or a
        kv_layout name): convert to another KV dtype on the way out (fresh scales); None: as stored."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        values = self._data[:, :, ids].permute(2, 0, 1, 3, 4, 5)
        scales = None if self._scales is None else self._scales[:, :, ids].movedim(2, 0)
        target = self.layout_for(as_dtype)
        if target.dtype == self.dtype:
            return self.layout.join(values.cpu(), None if scales is None else scales.cpu())
        return target.encode(kv_quant.dequantize_blocks(values, scales)).cpu()

    def export_blocks_async(self, blocks: list[int],
                            as_dtype: "torch.dtype | str | None" = None) -> "tuple[torch.Tensor, torch.cuda.Event | None]":
        """export_blocks without waiting for the device: on CUDA the blocks are gathered on the device (so their
        ids may be reused by the next step at once: the stream orders that write after the gather) and copied
        into pinned host memory asynchronously. Returns (buffers, event): the buffers may be read only once
        event.synchronize() returns (None: ready now, as on the CPU, where the pool already is host memory)."""
        if self.device.type != "cuda":
            return self.export_blocks(blocks, as_dtype), None
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        values = self._data[:, :, ids].permute(2, 0, 1, 3, 4, 5)
        scales = None if self._scales is None else self._scales[:, :, ids].movedim(2, 0)
        target = self.layout_for(as_dtype)
        if target.dtype == self.dtype:
            gathered = self.layout.join(values, scales)
        else:
            gathered = target.encode(kv_quant.dequantize_blocks(values, scales))
        host = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def import_blocks(self, blocks: list[int], data: torch.Tensor, layout: BlockLayout | None = None) -> None:
        """Write block buffers (uint8 [n, layout.nbytes], any device) into the given blocks. layout: what
        the buffers hold (export_blocks' layout_for(as_dtype)); another KV dtype than the pool's is
        converted to the pool's (fresh scales). None: the pool's own layout."""
        layout = self.layout if layout is None else layout
        if layout.with_dtype(self.dtype) != self.layout:
            raise ValueError(f"block layout {layout} does not fit this pool's blocks {self.layout}")
        if data.dtype != torch.uint8 or tuple(data.shape) != (len(blocks), layout.nbytes):
            raise ValueError(f"expected uint8 [{len(blocks)}, {layout.nbytes}] block buffers, got "
                             f"{data.dtype} {tuple(data.shape)}")
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        values, scales = layout.split(data.to(self.device))
        if layout.dtype != self.dtype:
            values, scales = kv_quant.quantize_blocks(kv_quant.dequantize_blocks(values, scales), self.dtype)
        self._data[:, :, ids] = values.permute(1, 2, 0, 3, 4, 5)
        if self._scales is not None:
            self._scales[:, :, ids] = scales.movedim(0, 2)
