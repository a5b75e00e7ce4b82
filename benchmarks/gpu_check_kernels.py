"""The paged Triton attention (model/attention_triton.py) against the torch path (model/attention.py) on given
shapes, and the KV pool's Triton kernels against its torch path (kv/triton_store.py: a step's K/V into the
pool, "kv_store"; kv/triton_rerope.py: an 8-bit pool's keys re-rotated in place, "rerope_8bit"): for `make
gpu-check`, which calls kernel_rows(device) and puts the rows into its JSON.

The pool kernels' rows: the shape, the largest |triton - torch| over what is read back (0 for the store: it
writes the torch path's bytes), the median time, and the bytes the kernel reads and writes (kv_bytes_read,
kv_bytes_written, their sum bytes_moved), values and scales.

Each row: the kernel ("paged_decode": one new token per sequence; "paged_extend": a run of new rows after a
cached prefix, causal), the shape, the largest |triton - torch| over the output, the kernel's median time
(seconds), and the KV bytes it has to read (the keys and values its rows see, scales included), from which
gpu-check derives the bandwidth reached against the card's measured copy speed.

On CUDA the shapes are the serving ones (Llama-3.1-8B: 32 query heads, 8 KV heads, head dim 128; the bundled
SmolLM2 and Gemma 3 270M); on the CPU (Triton's interpreter, TRITON_INTERPRET=1) small ones, as a check that
the script runs.

    TRITON_INTERPRET=1 python -m benchmarks.gpu_check_kernels --device cpu
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from reuse_server.kv.pool import KVPool
from reuse_server.model.attention import AttentionMetadata, paged_attention as torch_attention


@dataclass(frozen=True)
class KernelShape:
    name: str  # the model whose attention this is
    heads: int
    kv_heads: int
    head_dim: int
    batch: int  # sequences in the step
    context: int  # keys per sequence, the new rows' included
    new_rows: int  # query rows per sequence: 1 for decode
    window: int | None = None
    kv_dtype: str = "bfloat16"  # the pool's storage (a KVPool dtype name)
    dtype: str = "bfloat16"  # queries and outputs
    block_size: int = 16

    @property
    def kernel(self) -> str:
        return "paged_decode" if self.new_rows == 1 else "paged_extend"


LLAMA_8B = dict(name="llama-3.1-8b", heads=32, kv_heads=8, head_dim=128)
SMOLLM2 = dict(name="smollm2-135m", heads=9, kv_heads=3, head_dim=64)
GEMMA3 = dict(name="gemma3-270m-sliding", heads=4, kv_heads=1, head_dim=256, window=512)

CUDA_SHAPES = [
    KernelShape(**LLAMA_8B, batch=1, context=1024, new_rows=1),
    KernelShape(**LLAMA_8B, batch=8, context=1024, new_rows=1),
    KernelShape(**LLAMA_8B, batch=32, context=1024, new_rows=1),
    KernelShape(**LLAMA_8B, batch=1, context=8192, new_rows=1),
    KernelShape(**LLAMA_8B, batch=32, context=8192, new_rows=1),
    KernelShape(**LLAMA_8B, batch=32, context=8192, new_rows=1, kv_dtype="int8"),
    KernelShape(**LLAMA_8B, batch=32, context=8192, new_rows=1, kv_dtype="fp8_e4m3"),
    KernelShape(**LLAMA_8B, batch=1, context=8192, new_rows=512),  # a warm request's new tokens
    KernelShape(**LLAMA_8B, batch=1, context=8192, new_rows=8192),  # a cold prefill
    KernelShape(**SMOLLM2, batch=32, context=8192, new_rows=1),
    KernelShape(**GEMMA3, batch=32, context=8192, new_rows=1),
    KernelShape(**GEMMA3, batch=1, context=8192, new_rows=1024),
]
CPU_SHAPES = [
    KernelShape(**LLAMA_8B, batch=2, context=40, new_rows=1, dtype="float32", kv_dtype="float32"),
    KernelShape(**LLAMA_8B, batch=1, context=40, new_rows=8, dtype="float32", kv_dtype="int8"),
    KernelShape(**{**GEMMA3, "window": 16}, batch=1, context=40, new_rows=1, dtype="float32", kv_dtype="float32"),
]


def kernel_rows(device: "torch.device | str", shapes: list[KernelShape] | None = None, repeats: int | None = None,
                seed: int = 0) -> list[dict]:
    """One row per shape: {kernel, shape, max_abs_err, seconds, kv_bytes_read}. The Triton kernel must run on
    `device` (CUDA; the CPU only with TRITON_INTERPRET=1 set before triton was imported)."""
    from reuse_server.model.attention_triton import TritonAttentionKernel, runs_on

    device = torch.device(device)
    if not runs_on(device):
        raise RuntimeError(f"the Triton kernels do not run on {device} in this process (the CPU needs "
                           "TRITON_INTERPRET=1 before triton is imported)")
    pool_rows = shapes is None  # the defaults: the pool's kernels' rows too
    shapes = shapes if shapes is not None else (CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES)
    repeats = repeats or (20 if device.type == "cuda" else 1)
    kernel = TritonAttentionKernel()
    rows = []
    for shape in shapes:
        pool, meta, positions, q = _step(shape, device, seed)
        plan = kernel.plan(meta, positions, pool, shape.heads)
        scale = shape.head_dim ** -0.5
        ours = kernel(q, plan, pool, 0, scale, shape.window)  # also the warm-up (compiles on a GPU)
        theirs = torch_attention(q, meta, meta.sequence_masks(positions, shape.window, q.dtype), pool, 0, scale)
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            kernel(q, plan, pool, 0, scale, shape.window)
            _sync(device)
            times.append(time.perf_counter() - start)
        rows.append({"kernel": shape.kernel, "shape": asdict(shape),
                     "max_abs_err": (ours.float() - theirs.float()).abs().max().item(),
                     "seconds": statistics.median(times), "kv_bytes_read": kv_bytes_read(shape, pool)})
        del pool, meta, q, ours, theirs
    if pool_rows:
        on_gpu = device.type == "cuda"
        rows += store_rows(device, STORE_SHAPES if on_gpu else CPU_STORE_SHAPES, repeats, seed)
        rows += rerope_rows(device, REROPE_SHAPES if on_gpu else CPU_REROPE_SHAPES, repeats, seed)
    return rows


@dataclass(frozen=True)
class PoolKernelShape:
    name: str
    kv_heads: int
    head_dim: int
    tokens: int  # rows written (store) or keys moved (re-RoPE), at scattered slots
    kv_dtype: str
    dtype: str = "bfloat16"  # the rows written
    layers: int = 1  # re-RoPE: every layer in one launch
    block_size: int = 16


STORE_SHAPES = [PoolKernelShape("llama-3.1-8b", 8, 128, tokens, kv_dtype)
                for tokens in (32, 8192) for kv_dtype in ("bfloat16", "int8", "fp8_e4m3")]
REROPE_SHAPES = [PoolKernelShape("llama-3.1-8b", 8, 128, 4096, kv_dtype, layers=32) for kv_dtype in ("int8", "fp8_e4m3")]
CPU_STORE_SHAPES = [PoolKernelShape("smollm2-135m", 3, 64, 12, kv_dtype, dtype="float32", block_size=4)
                    for kv_dtype in ("float32", "int8", "fp8_e4m3")]
CPU_REROPE_SHAPES = [PoolKernelShape("smollm2-135m", 3, 64, 12, kv_dtype, dtype="float32", layers=2, block_size=4)
                     for kv_dtype in ("int8", "fp8_e4m3")]


def _pool_pair(shape: PoolKernelShape, device: torch.device, blocks: int) -> tuple[KVPool, KVPool]:
    """(torch pool, Triton pool), both empty."""
    ref, ours = (KVPool(shape.layers, blocks, shape.block_size, shape.kv_heads, shape.head_dim, shape.kv_dtype,
                        device, read_dtype=getattr(torch, shape.dtype), native_store=False) for _ in range(2))
    if not ours.use_triton_kernels():
        raise RuntimeError(f"the pool's Triton kernels do not run on {device}")
    return ref, ours


def _scale_bytes(pool: KVPool, tokens: int) -> int:
    """The scale bytes of `tokens` rows of one plane: int8's per slot, fp8's per block (one per written block
    at most)."""
    if pool.scale_per == "token":
        return tokens * pool.num_kv_heads * 4
    if pool.scale_per == "block":
        return -(-tokens // pool.block_size) * pool.num_kv_heads * 4
    return 0


def store_rows(device: torch.device, shapes: list[PoolKernelShape], repeats: int, seed: int = 0) -> list[dict]:
    """Per shape: a step's K and V rows into scattered slots of a layer (a fresh block for every block_size rows,
    in random order) through KVPool.write, Triton against torch."""
    rows = []
    for shape in shapes:
        gen = torch.Generator(device=device).manual_seed(seed)
        blocks = -(-shape.tokens // shape.block_size)
        ref, ours = _pool_pair(shape, device, blocks)
        order = torch.randperm(blocks, generator=gen, device=device)
        offsets = torch.arange(shape.tokens, device=device)
        slots = order[offsets // shape.block_size] * shape.block_size + offsets % shape.block_size
        k, v = (torch.randn(shape.tokens, shape.kv_heads, shape.head_dim, generator=gen, device=device,
                            dtype=getattr(torch, shape.dtype)) for _ in range(2))
        ref.write(0, slots, k, v)
        ours.write(0, slots, k, v)  # also the warm-up (compiles on a GPU)
        every = torch.arange(ours.num_slots, device=device)
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours.read(0, every), ref.read(0, every)))
        times = _timed(lambda: ours.write(0, slots, k, v), device, repeats)
        values = shape.tokens * shape.kv_heads * shape.head_dim
        read = 2 * values * k.element_size()
        written = 2 * (values * ours._data.element_size() + _scale_bytes(ours, shape.tokens))
        if ours.scale_per == "block":  # a block's kept tokens and scale are read too
            read += 2 * (values * ours._data.element_size() + _scale_bytes(ours, shape.tokens))
        rows.append({"kernel": "kv_store", "shape": asdict(shape), "max_abs_err": err,
                     "seconds": statistics.median(times), "kv_bytes_read": read, "kv_bytes_written": written,
                     "bytes_moved": read + written})
    return rows


def rerope_rows(device: torch.device, shapes: list[PoolKernelShape], repeats: int, seed: int = 0) -> list[dict]:
    """Per shape: a moved chunk's keys (scattered slots, thousands of positions on) re-rotated in place in every
    layer of an 8-bit pool through KVPool.update_keys, Triton against torch (dequantize, rotate, requantize)."""
    from blend.key_shift import moved_keys
    from blend.rope import default_inv_freq

    rows = []
    for shape in shapes:
        gen = torch.Generator(device=device).manual_seed(seed)
        blocks = -(-shape.tokens // shape.block_size)
        ref, ours = _pool_pair(shape, device, blocks)
        every = torch.arange(ours.num_slots, device=device)
        for layer in range(shape.layers):
            k, v = (torch.randn(ours.num_slots, shape.kv_heads, shape.head_dim, generator=gen, device=device)
                    for _ in range(2))
            ref.write(layer, every, k, v)
            ours.write(layer, every, k, v)
        slots = torch.randperm(ours.num_slots, generator=gen, device=device)[:shape.tokens]
        old = torch.arange(shape.tokens, device=device)
        move = moved_keys(old, old + 5000, default_inv_freq(shape.head_dim).to(device))
        ref.update_keys(slots, move)
        ours.update_keys(slots, move)  # also the warm-up
        err = max((a - b).abs().max().item() for a, b in zip(ours.read_keys(every), ref.read_keys(every)))
        times = _timed(lambda: ours.update_keys(slots, move), device, repeats)
        moved = shape.layers * (shape.tokens * shape.kv_heads * shape.head_dim + _scale_bytes(ours, shape.tokens))
        read = moved * (1 if ours.scale_per == "token" else 2)  # fp8: the rotated block's kept keys are read too
        rows.append({"kernel": "rerope_8bit", "shape": asdict(shape), "max_abs_err": err,
                     "seconds": statistics.median(times), "kv_bytes_read": read, "kv_bytes_written": moved,
                     "bytes_moved": read + moved})
    return rows


def _timed(run, device: torch.device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def kv_bytes_read(shape: KernelShape, pool: KVPool) -> int:
    """The K/V bytes (with their scales) the step's rows see: per sequence, its context, or with a window the
    keys from the first new row's window start on."""
    keys = shape.context
    if shape.window is not None:
        keys = min(shape.context, shape.window + shape.new_rows - 1)
    per_key = 2 * shape.kv_heads * (shape.head_dim * pool._data.element_size())
    if pool.scale_per == "token":
        per_key += 2 * shape.kv_heads * 4
    elif pool.scale_per == "block":
        per_key += 2 * shape.kv_heads * 4 / shape.block_size
    return int(shape.batch * keys * per_key)


def _step(shape: KernelShape, device: torch.device, seed: int):
    """A pool holding each sequence's context on blocks in random order, and the step's queries."""
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    per_seq = -(-shape.context // shape.block_size)
    pool = KVPool(1, shape.batch * per_seq, shape.block_size, shape.kv_heads, shape.head_dim, shape.kv_dtype,
                  device, read_dtype=dtype, native_store=False)
    ids = list(range(pool.num_blocks))
    rng.shuffle(ids)
    tables = [torch.tensor(ids[s * per_seq:(s + 1) * per_seq], device=device) for s in range(shape.batch)]
    chunk = 1 << 16  # slots written at a time: bounds the random K/V's memory
    for first in range(0, pool.num_slots, chunk):
        slots = torch.arange(first, min(first + chunk, pool.num_slots), device=device)
        kv_shape = (len(slots), shape.kv_heads, shape.head_dim)
        pool.write(0, slots, torch.randn(kv_shape, generator=gen, device=device, dtype=dtype),
                   torch.randn(kv_shape, generator=gen, device=device, dtype=dtype))
    starts = [s * shape.new_rows for s in range(shape.batch + 1)]
    positions = torch.arange(shape.context - shape.new_rows, shape.context, device=device).repeat(shape.batch)
    meta = AttentionMetadata(starts, tables, [shape.context] * shape.batch,
                             torch.zeros(len(positions), dtype=torch.long, device=device))
    q = torch.randn((len(positions), shape.heads, shape.head_dim), generator=gen, device=device, dtype=dtype)
    return pool, meta, positions, q


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    for row in kernel_rows(args.device):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
