"""The CPU's paged attention kernel (cpu_attention.cpp, built by native.py): its plan and its call. fp32
arithmetic over a pool stored in any of the KV dtypes (the 8-bit ones with their scales), read in place.

torch's CPU attention needs K/V as dense tensors, so a paged pool costs a gather per layer (or a view where a
sequence's blocks happen to be consecutive), and its flash kernel spends its time in small MKL products that
take a generic path on AMD CPUs. The kernel reads K/V in place through the block table and keeps the query
heads that share a KV head as one set of rows: faster than the torch path for a warm request's new tokens, a
causal prefill and decode batches alike (BENCHMARKS.md, "CPU kernel choices")."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native


@functools.cache
def load() -> "CpuAttentionKernel | None":
    """The kernel, built on first use; None where it cannot be built (`native.failure()` says why)."""
    library = native.load()
    return None if library is None else CpuAttentionKernel(library)


# The kernel's codes for the pool's storage dtypes (cpu_attention.cpp, kv_paged_attention).
FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.int8: 4}


class CpuAttentionKernel:
    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.kv_paged_attention_f32
        self._any = lib.kv_paged_attention

    @staticmethod
    def takes(q: torch.Tensor, pool) -> bool:
        """Whether this call's tensors suit the kernel: fp32 queries on the CPU, a pool it reads (takes_pool)."""
        return (q.device.type == "cpu" and q.dtype == torch.float32 and CpuAttentionKernel.takes_pool(pool)
                and q.stride(-1) == 1 and q.stride(-2) == pool.head_dim)

    @staticmethod
    def takes_pool(pool) -> bool:
        """A pool on the CPU stored in fp32, fp16, bf16, fp8 e4m3 or int8, head_dim 16, 32, 64, 128 or 256."""
        return pool.dtype in FORMATS and pool.device.type == "cpu" and pool.head_dim in (16, 32, 64, 128, 256)

    @staticmethod
    def plan(meta, positions: torch.Tensor, pool, num_heads: int) -> "KernelPlan":
        """The step's plan (meta: attention.AttentionMetadata), built once and shared by every layer."""
        return KernelPlan(meta.query_start, meta.block_tables, meta.context_lens, positions, pool.block_size,
                          pool.num_blocks)

    def __call__(self, q: torch.Tensor, plan: "KernelPlan", pool, layer: int, scale: float,
                 window: int | None) -> torch.Tensor:
        """q: [T, heads, head_dim] (post-RoPE; a view with a wider token stride is fine). Returns [T, heads,
        head_dim]; every token's own K/V must already be in the pool."""
        t, heads, hd = q.shape
        out = torch.empty((t, heads, hd), dtype=q.dtype)
        k, v = pool.layer_blocks(layer)
        shape = (plan.num_sequences, plan.seq_info.data_ptr(), plan.block_tables.data_ptr(),
                 plan.positions.data_ptr(), heads, pool.num_kv_heads, hd, pool.block_size, window or 0, scale,
                 torch.get_num_threads())
        if pool.dtype == torch.float32:
            status = self._fn(q.data_ptr(), q.stride(0), out.data_ptr(), k.data_ptr(), v.data_ptr(), *shape)
        else:
            ks, vs = pool.layer_scales(layer)
            status = self._any(q.data_ptr(), q.stride(0), out.data_ptr(), k.data_ptr(), v.data_ptr(),
                               0 if ks is None else ks.data_ptr(), 0 if vs is None else vs.data_ptr(),
                               FORMATS[pool.dtype], *shape)
        if status != 0:
            raise ValueError(f"the CPU attention kernel does not take heads={heads} kv_heads={pool.num_kv_heads} "
                             f"head_dim={hd} block_size={pool.block_size}")
        return out


class KernelPlan:
    """A step's sequences in the kernel's terms, built once and shared by every layer: per sequence (first
    query token, end query token, context length, offset of its block table), the block tables end to end,
    and the query positions as int64."""

    def __init__(self, query_start: list[int], block_tables: list[torch.Tensor], context_lens: list[int],
                 positions: torch.Tensor, block_size: int, num_blocks: int):
        n = len(query_start) - 1
        if len(block_tables) != n or len(context_lens) != n:
            raise ValueError("query_start, block_tables and context_lens disagree on the number of sequences")
        if query_start[0] != 0 or query_start[-1] != positions.shape[0]:
            raise ValueError(f"query_start {query_start} does not cover the {positions.shape[0]} query tokens")
        info, offset = [], 0
        for s in range(n):
            lo, hi, ctx = query_start[s], query_start[s + 1], context_lens[s]
            if hi < lo or len(block_tables[s]) * block_size < ctx:
                raise ValueError(f"sequence {s}: {len(block_tables[s])} blocks cannot hold {ctx} positions")
            info.append((lo, hi, ctx, offset))
            offset += len(block_tables[s])
        self.positions = positions.to(torch.int64).contiguous()
        # Checked in Python: at a decode step's few rows a torch op costs more than the loop (and a step's
        # Python runs with caches the weights just went through).
        listed = self.positions.tolist()
        for s in range(n):  # each token's position against its own sequence's context length
            lo, hi, ctx = info[s][0], info[s][1], info[s][2]
            if hi > lo and not (0 <= min(listed[lo:hi]) and max(listed[lo:hi]) < ctx):
                raise ValueError("query positions must lie in [0, context length) of their sequence")
        self.num_sequences = n
        self.seq_info = torch.tensor(info, dtype=torch.int64).reshape(n, 4)
        self.block_tables = (torch.cat([t.to(torch.int64) for t in block_tables]) if offset
                             else torch.zeros(1, dtype=torch.int64))
        if offset:
            lowest, highest = torch.aminmax(self.block_tables)
            if int(lowest) < 0 or int(highest) >= num_blocks:
                raise ValueError(f"block ids must lie in [0, {num_blocks})")
