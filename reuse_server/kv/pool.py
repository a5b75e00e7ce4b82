"""The paged KV pool: every token's K and V, in fixed-size blocks, in one allocation. The only code that
touches KV memory: the model writes through it, attention reads through it, blending moves keys through it
and edits them through a callback it passes in (re-RoPE and the key shift are blend's, see update_keys), and
tiers export and import whole blocks through it (what a block looks like as bytes is block_codec.py's).

A token's KV lives at a *slot*: slot = block_id * block_size + offset. A sequence owns an ordered list of
block ids (its block table); position p of that sequence lives in block_table[p // block_size] at offset
p % block_size. K is stored after RoPE. Which blocks belong to whom is decided elsewhere (radix/, the block
manager); this class only stores and moves tensors.

Layout: one tensor [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]. Each layer's K (and V) is then
one contiguous [blocks, block_size, kv_heads, head_dim] array, which is what the attention kernels read in
place through a block table; one block's KV of every layer is `data[:, :, block]`, which export and import
move in one strided copy, so a tier gets a block as one contiguous buffer; a tier's read may also land
straight in blocks its caller took (read_targets: the views of their memory, in a buffer's order).

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

import collections
import functools
import threading
from dataclasses import dataclass, field

import torch

from reuse_server.kv import block_codec, layout as kv_layout, quant as kv_quant
from reuse_server.kv.block_codec import BlockLayout
from reuse_server.kv.window_policy import NoWindow

K, V = 0, 1


@dataclass(frozen=True)
class PoolMemory:
    """What a pool reports of its memory (LLMEngine.memory shows it): the storage dtype, a block's bytes (every
    layer), the pool's bytes, the bytes its used blocks take, and a hybrid pool's window-part counts."""

    kv_dtype: str
    bytes_per_block: int
    pool_bytes: int
    held_bytes: int
    window: dict = field(default_factory=dict)


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
        self._triton = False  # use_triton_kernels
        # kernel launches by name ("store", "rerope"): what ran, for tests and the curious
        self.kernel_launches: collections.Counter = collections.Counter()
        self._staging: PinnedStaging | None = None  # made at the first export from a CUDA pool
        self._plane_bytes = None  # the data as uint8 planes, for read_targets (made at its first call)
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

    layered = False

    def use_triton_kernels(self, enable: bool = True) -> bool:
        """Write K/V through the Triton store kernel (triton_store.py: one launch a layer for K and V, their
        8-bit scales computed in it) and re-RoPE an 8-bit pool's keys in place (triton_rerope.py), as
        `--attention-backend triton` does; False: torch's ops (or the C++ store). Returns whether the kernels
        are in use: they run on CUDA, and on the CPU only in Triton's interpreter."""
        self._triton = False
        if enable:
            from reuse_server.model.attention_triton import runs_on  # imports triton: only where asked for

            self._triton = runs_on(self.device)
        return self._triton

    def place(self, layer: int) -> tuple["KVPool", int]:
        """(the pool that holds `layer`, its index there): this pool, for every layer."""
        return self, layer

    def route(self, layer: int, meta):
        """(pool, its index for `layer`, `meta` in that pool's block ids): this pool holds every layer
        (LayeredKVPool splits a hybrid model's)."""
        return self, layer, meta

    def exportable(self, block: int) -> bool:
        """Whether the block's KV is whole here for a tier to take (always, in a pool of one layer group)."""
        return True

    def window_policy(self) -> NoWindow:
        """What the block manager does for window layers here: nothing (this pool holds every layer of a block)."""
        return NoWindow()

    def memory(self, used_blocks: int) -> PoolMemory:
        """This pool's memory figures, `used_blocks` of its blocks being in use or cached."""
        return PoolMemory(str(self.dtype).removeprefix("torch."), self.layout.nbytes, self.nbytes,
                          used_blocks * self.layout.nbytes)

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

    def kernel_storage(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Every layer's K/V as stored, [layers, 2, blocks, block_size, kv_heads, head_dim], and its scales (as
        layer_scales lays them out, one more leading [layers, 2]; None for the plain dtypes): for the native
        decode (cpu_decode.cpp), which writes a step's K/V itself through the kernels `write` uses, so its writes
        are `write`'s. None where `write` would not run those kernels: a pool off the CPU, one writing through
        Triton (use_triton_kernels), an 8-bit one whose store kernel is not built."""
        if self.device.type != "cpu" or self._triton or (self.quantized and self._native_store is None):
            return None
        return self._data, self._scales

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
        """Store k/v [T, kv_heads, head_dim] at slots [T] (distinct), quantized to the pool's dtype: through the
        Triton store kernel with use_triton_kernels (the same bytes), else torch's ops or the C++ store."""
        slots = self._slots(slots)
        if self._triton:
            from reuse_server.kv import triton_store

            triton_store.store(self._data[layer], None if self._scales is None else self._scales[layer], slots, k, v)
            self.kernel_launches["store"] += 1
            return
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

    @property
    def rotates_in_place(self) -> bool:
        """Whether update_keys takes a KeyMove (re-RoPE, key shift) into the Triton kernel (an 8-bit pool using it)."""
        return self._triton and self.quantized

    def update_keys(self, slots: torch.Tensor, change) -> None:
        """change(k_caches, idx) edits, in place, the keys at idx of per-layer paged key caches ([blocks,
        block_size, kv_heads, head_dim] each, as blend's re-RoPE and key shift take them; the blender passes
        the change in, so the pool knows nothing of rotations): the pool's own
        for a plain dtype; for an 8-bit pool, dequantized fp32 copies of the keys at slots, which are then
        requantized with fresh scales (an fp8 block at the scale its old and new tokens need together); an fp16
        or bf16 pool also edits fp32 copies, so that a re-RoPE and a shift round the keys once. An 8-bit pool
        with use_triton_kernels takes a change that offers itself as data (`in_place`: blend's KeyMove, a
        re-RoPE and maybe a shift) into one Triton launch that edits the codes in place, every layer
        (triton_rerope.py)."""
        slots = self._slots(slots)
        if self.dtype == torch.float32:
            change([self._data[layer, K] for layer in range(self.num_layers)], slots)
            return
        if slots.numel() == 0:
            return
        move = getattr(change, "in_place", None)  # blend's KeyMove as data
        if self.rotates_in_place and move is not None:
            from reuse_server.kv import triton_rerope

            triton_rerope.rerope_(self._data[:, K], self._scales[:, K], slots, move.old_positions.to(self.device),
                                  move.new_positions.to(self.device), move.inv_freq_table(self.num_layers),
                                  move.shift_table())
            self.kernel_launches["rerope"] += 1
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
        buffers, copied = self.export_blocks_async(blocks, as_dtype)
        if copied is not None:
            copied.synchronize()
        return buffers

    def export_blocks_async(self, blocks: list[int], as_dtype: "torch.dtype | str | None" = None,
                            into=None) -> "tuple[torch.Tensor, StagedCopy | PinnedCopy | None]":
        """export_blocks without waiting for the device: on CUDA the blocks are gathered on the device (so their
        ids may be reused by the next step at once: the stream orders that write after the gather) and copied
        to the host through the pool's pinned staging buffer asynchronously, or straight into pinned buffers
        of their own where `into` (kv.tiers.host_memory: the host tier's memory) is pinned. Returns (buffers,
        copied): the buffers may be read only once copied.synchronize() returns (None: ready now, as on the
        CPU, where the pool already is host memory)."""
        if self._scales is None and self.layout_for(as_dtype) == self.layout:
            packed = self._gather_runs(blocks)
        else:
            ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
            values = self._data[:, :, ids].permute(2, 0, 1, 3, 4, 5)
            scales = None if self._scales is None else self._scales[:, :, ids].movedim(2, 0)
            packed = block_codec.pack(values, scales, self.layout, self.layout_for(as_dtype))
        if self.device.type != "cuda":
            return packed.cpu(), None
        if into is not None and into.pinned:
            return copy_to_pinned(packed, into)
        if self._staging is None:
            self._staging = PinnedStaging()
        return self._staging.copy_out(packed)

    def _native_copy(self):
        """The C++ block copy (cpu_kv_store), where it applies: a CPU pool without scales; else None."""
        if self.device.type != "cpu" or self._scales is not None:
            return None
        from reuse_server.model import cpu_kv_store

        return cpu_kv_store.load()

    def _gather_runs(self, blocks: list[int]) -> torch.Tensor:
        """Blocks as stored, as block buffers (uint8 [n, layout.nbytes]), in one copy: each run of consecutive
        ids is one strided copy into the new buffer (an indexed gather, then a reordering copy, would write
        every byte twice, into two fresh buffers)."""
        native = self._native_copy()
        if native is not None:
            out = torch.empty((len(blocks), self.layout.nbytes), dtype=torch.uint8)
            base, nbytes = out.data_ptr(), self.layout.nbytes
            native.copy_blocks(self._data, blocks, [base + i * nbytes for i in range(len(blocks))], to_pool=False)
            return out
        out = torch.empty((len(blocks), *self.layout.shape), dtype=self.dtype, device=self.device)
        start = 0
        for end in range(1, len(blocks) + 1):
            if end < len(blocks) and blocks[end] == blocks[end - 1] + 1:
                continue
            first = blocks[start]
            out[start:end].copy_(self._data[:, :, first:first + end - start].permute(2, 0, 1, 3, 4, 5))
            start = end
        return out.view(torch.uint8).view(len(blocks), self.layout.nbytes)

    def import_blocks(self, blocks: list[int], data: torch.Tensor, layout: BlockLayout | None = None) -> None:
        """Write block buffers (uint8 [n, layout.nbytes], any device) into the given blocks. layout: what
        the buffers hold (export_blocks' layout_for(as_dtype)); another KV dtype than the pool's is
        converted to the pool's (fresh scales). None: the pool's own layout."""
        layout = self.layout if layout is None else layout
        block_codec.check_fits(layout, self.layout)
        if data.dtype != torch.uint8 or tuple(data.shape) != (len(blocks), layout.nbytes):
            raise ValueError(f"expected uint8 [{len(blocks)}, {layout.nbytes}] block buffers, got "
                             f"{data.dtype} {tuple(data.shape)}")
        values, scales = block_codec.unpack(upload(data, self.device), layout, self.layout)
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):  # a slice copies faster than an index
            ids = slice(blocks[0], blocks[0] + len(blocks))
        else:
            ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self._data[:, :, ids] = values.permute(1, 2, 0, 3, 4, 5)
        if self._scales is not None:
            self._scales[:, :, ids] = scales.movedim(0, 2)

    def import_rows(self, blocks: list[int], rows: list[torch.Tensor], layout: BlockLayout | None = None) -> None:
        """import_blocks for block buffers given one by one (uint8 [layout.nbytes] each): rows lying next to
        each other in memory, in order (a tier's read buffer, one export's batch), go in as one copy, with no
        stacking into a new buffer first (on a CPU server the fresh pages of such a stack cost more than the
        copy itself)."""
        native = self._native_copy() if layout is None or layout == self.layout else None
        if native is None:
            import_in_runs(self, blocks, rows, layout)
            return
        nbytes = self.layout.nbytes
        for row in rows:
            if row.dtype != torch.uint8 or row.dim() != 1 or row.numel() != nbytes or not row.is_contiguous() \
                    or row.device.type != "cpu":
                raise ValueError(f"expected uint8 [{nbytes}] block buffers, got {row.dtype} {tuple(row.shape)}")
        native.copy_blocks(self._data, blocks, [row.data_ptr() for row in rows], to_pool=True)

    def read_targets(self, blocks: list[int], layout: BlockLayout | None = None) -> "list[list] | None":
        """Where a read may put whole block buffers straight into the pool (a tier's file or socket read, with
        no buffer in between and no copy after): per block, writable views of its memory (uint8 numpy arrays,
        one per layer's K and V, in the order of export_blocks' row), which together take what import_rows
        would write. The caller owns the blocks and uses one only once its read is checked (a failed read
        leaves whatever came). None where a block buffer is not the pool's bytes as they lie (another layout,
        an 8-bit pool's scales, memory not on the CPU): read into buffers and import_rows them then."""
        if ((layout is not None and layout != self.layout) or self._scales is not None or self.device.type != "cpu"
                or not self._data.is_contiguous()):
            return None
        if self._plane_bytes is None:
            # [layers * 2, blocks, one block's bytes of one layer's K or V]: each [plane, block] row is contiguous
            self._plane_bytes = self._data.view(torch.uint8).numpy().reshape(self.num_layers * 2, self.num_blocks, -1)
        return [list(self._plane_bytes[:, block]) for block in blocks]


def import_in_runs(pool, blocks: list[int], rows: list[torch.Tensor], layout=None) -> None:
    """pool.import_blocks for each run of rows lying next to each other in memory, as one [n, nbytes] view."""
    if len(blocks) != len(rows):
        raise ValueError(f"{len(blocks)} blocks for {len(rows)} buffers")
    nbytes = (pool.layout if layout is None else layout).nbytes
    start = 0
    for end in range(1, len(rows) + 1):
        if end < len(rows) and _adjacent(rows[end - 1], rows[end], nbytes):
            continue
        first = rows[start]
        if first.dim() != 1 or first.numel() != nbytes or not first.is_contiguous():
            raise ValueError(f"expected uint8 [{nbytes}] block buffers, got {first.dtype} {tuple(first.shape)}")
        pool.import_blocks(blocks[start:end], first.as_strided((end - start, nbytes), (nbytes, 1)), layout)
        start = end


def _adjacent(row: torch.Tensor, following: torch.Tensor, nbytes: int) -> bool:
    """Whether `following` starts where `row` (uint8 [nbytes], contiguous) ends, in the same memory."""
    return (following.device == row.device and following.dtype == row.dtype == torch.uint8
            and row.is_contiguous() and following.is_contiguous() and row.numel() == following.numel() == nbytes
            and following.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()
            and following.data_ptr() == row.data_ptr() + nbytes)


class StagedCopy:
    """One export's device -> host copy through the pinned staging buffer: `synchronize()` waits for the
    copy into staging and moves the bytes on into the export's own (pageable) buffers, once, from whichever
    thread asks first (the engine thread before the staging is reused, or a tier's writer)."""

    def __init__(self, event: "torch.cuda.Event", staged: torch.Tensor, out: torch.Tensor):
        self._event = event
        self._staged: torch.Tensor | None = staged
        self._out = out
        self._lock = threading.Lock()

    def synchronize(self) -> None:
        with self._lock:
            if self._staged is None:
                return
            self._event.synchronize()
            self._out.copy_(self._staged)
            self._staged = None  # the staging buffer may now be reused


class PinnedCopy:
    """One export's device -> host copy straight into pinned buffers the tier keeps: `synchronize()` waits for
    it (nothing to move on)."""

    def __init__(self, event: "torch.cuda.Event"):
        self._event = event

    def synchronize(self) -> None:
        self._event.synchronize()


def copy_to_pinned(packed: torch.Tensor, memory) -> tuple[torch.Tensor, PinnedCopy]:
    """packed (on the device) into a new buffer of pinned `memory`, asynchronously."""
    out = memory.empty(tuple(packed.shape), packed.dtype)
    out.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return out, PinnedCopy(event)


class PinnedStaging:
    """The pinned host memory exports from a CUDA pool go through, allocated once (and grown only when an
    export is larger than any before), instead of a pinned buffer per export that a tier would then hold for
    as long as it keeps the blocks. An export first settles the one before it (its bytes are still in the
    staging buffer until they are moved on), which by then has long finished on the device."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._pending: StagedCopy | None = None

    def copy_out(self, packed: torch.Tensor) -> tuple[torch.Tensor, StagedCopy]:
        if self._pending is not None:
            self._pending.synchronize()
        n = packed.numel()
        if self._buffer is None or self._buffer.numel() < n:
            grown = 0 if self._buffer is None else 2 * self._buffer.numel()
            self._buffer = torch.empty(max(n, grown), dtype=torch.uint8, pin_memory=True)
        staged = self._buffer[:n].view(packed.shape)
        staged.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        out = torch.empty(packed.shape, dtype=torch.uint8)
        self._pending = StagedCopy(event, staged, out)
        return out, self._pending


def upload(data: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` on `device`: on CUDA from pinned host memory asynchronously (HostUploads), else as torch copies."""
    if device.type == "cuda" and data.device.type == "cpu" and data.is_pinned():
        return HostUploads.of(device).copy(data)
    return data.to(device)


class HostUploads:
    """Host -> device copies of blocks loaded from a tier into a CUDA pool (tiers/reads.PinnedReadBuffer's rows):
    non_blocking from pinned memory on a side stream, so the engine thread goes on while the bytes cross, and
    the compute stream waits for the copy's event before anything it queues after uses them. The host memory of
    the last copy may be written again only after `wait()` (PinnedReadBuffer asks before reusing its rows).
    One per device, shared by a layered pool's two pools."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._last: torch.cuda.Event | None = None

    @staticmethod
    def of(device: torch.device) -> "HostUploads":
        device = torch.device(device)
        return _uploads(torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index))

    def copy(self, data: torch.Tensor) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):  # allocated on the side stream: the allocator orders its reuse there
            out = data.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        compute.wait_event(copied)  # the pool's writes and every step after see the bytes
        out.record_stream(compute)  # nor is its memory given to the side stream again before they have run
        self._last = copied
        return out

    def wait(self) -> None:
        """Until the last copy has read its host memory."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None


@functools.cache
def _uploads(device: torch.device) -> HostUploads:
    return HostUploads(device)
