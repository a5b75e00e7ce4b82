"""Quantizing writes into an 8-bit KV pool through the C++ kernel (cpu_kv_store.cpp), on the CPU: the pool's
torch arithmetic for fp8 and int8 (kv_pool.KVPool._store_planes) bit for bit, in one call instead of some
thirty small tensor operations per write. And whole blocks copied in and out of a pool (tier hits, exports)."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native


class NativeKVStore:
    def __init__(self, library: ctypes.CDLL):
        self._fp8 = library.kv_store_fp8
        self._int8 = library.kv_store_int8
        self._copy = library.kv_copy_blocks

    def copy_blocks(self, data: torch.Tensor, blocks: list[int], rows: list[int], to_pool: bool) -> None:
        """Copy whole blocks between a pool's data [layers, 2, blocks, ...] (contiguous) and block buffers at
        the addresses `rows` (each [layers, 2, ...one block...] contiguous): into the pool or out of it."""
        if not data.is_contiguous() or data.device.type != "cpu":
            raise ValueError("the pool's data must be contiguous CPU memory")
        if len(blocks) != len(rows):
            raise ValueError(f"{len(blocks)} blocks for {len(rows)} buffers")
        ids = torch.tensor(blocks, dtype=torch.int64)
        if len(blocks) and not (0 <= int(ids.min()) and int(ids.max()) < data.shape[2]):
            raise ValueError(f"block ids outside the pool's {data.shape[2]} blocks")
        addresses = (ctypes.c_void_p * len(rows))(*rows)
        size = data.element_size()
        self._copy(data.data_ptr(), data.stride(1) * size, ids.data_ptr(), addresses, len(blocks),
                   data.shape[0] * data.shape[1], data.stride(2) * size, int(to_pool), torch.get_num_threads())

    def store(self, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize values [planes, n, heads, dim] into slots [n] (distinct) of planes of the pool: data
        [planes, blocks, block_size, heads, dim] (float8_e4m3fn or int8) with scales [planes, blocks, heads]
        (fp8) or [planes, blocks, block_size, heads] (int8), each plane contiguous."""
        planes, blocks, block_size, heads, dim = data.shape
        if not (data[0].is_contiguous() and scales[0].is_contiguous()):
            raise ValueError("each plane of the pool's data and scales must be contiguous")
        values = values.to(torch.float32).contiguous()
        slots = slots.to(torch.int64).contiguous()
        if data.dtype == torch.int8:
            self._int8(data.data_ptr(), scales.data_ptr(), planes, data.stride(0), scales.stride(0), heads, dim,
                       slots.data_ptr(), slots.numel(), values.data_ptr(), torch.get_num_threads())
        else:
            self._fp8(data.data_ptr(), scales.data_ptr(), planes, data.stride(0), scales.stride(0), block_size,
                      heads, dim, slots.data_ptr(), slots.numel(), values.data_ptr(), torch.get_num_threads())


@functools.cache
def load() -> NativeKVStore | None:
    """The kernel, built with the other kernels on first use; None where it cannot be built."""
    library = native.load()
    return None if library is None else NativeKVStore(library)
