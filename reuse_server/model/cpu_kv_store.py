"""Quantizing writes into an 8-bit KV pool through the C++ kernel (cpu_kv_store.cpp), on the CPU: the pool's
torch arithmetic for fp8 and int8 (kv_pool.KVPool._store_planes) bit for bit, in one call instead of some
thirty small tensor operations per write."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native


class NativeKVStore:
    def __init__(self, library: ctypes.CDLL):
        self._fp8 = library.kv_store_fp8
        self._int8 = library.kv_store_int8

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
