"""The paged Triton attention (model/attention_triton.py) against the torch path (model/attention.py) on given
shapes: for `make gpu-check`, which calls kernel_rows(device) and puts the rows into its JSON.

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
    return rows


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
