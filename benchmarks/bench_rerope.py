"""Time re-RoPE of a request's reused keys across all layers: torch path vs Triton kernel.

Prints one JSON line per (backend, device) measurement. The Triton kernel runs only when
CUDA is available (a line with "skipped" says so otherwise); the torch path is timed on the
CPU always and on CUDA when present. Default shape: 4,096 tokens x 30 layers x 3 kv heads
x head dim 64 (SmolLM2-135M), tokens scattered over a paged pool of 16-token blocks.

    python -m benchmarks.bench_rerope [--tokens 4096 --layers 30 --kv-heads 3 --head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blend.rope import default_inv_freq, rerope_, rerope_layers_, triton_available

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_backend(args: argparse.Namespace, backend: str, device: torch.device, mode: str) -> dict:
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    num_blocks = 2 * -(-args.tokens // args.block_size)
    pools = [
        torch.randn(num_blocks, args.block_size, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
        for _ in range(args.layers)
    ]
    slots = torch.randperm(num_blocks * args.block_size, generator=gen)[: args.tokens].to(device)
    old_pos = torch.randint(0, 32768, (args.tokens,), generator=gen).to(device)
    new_pos = torch.randint(0, 32768, (args.tokens,), generator=gen).to(device)
    inv_freq = default_inv_freq(args.head_dim).to(device)

    def all_layers() -> None:
        if mode == "all_layers_call":  # rerope_layers_: cos/sin computed once (torch path)
            rerope_layers_(pools, slots, old_pos, new_pos, inv_freq, backend=backend)
        else:  # one rerope_ call per layer
            for pool in pools:
                rerope_(pool, slots, old_pos, new_pos, inv_freq, backend=backend)

    for _ in range(args.warmup):
        all_layers()
    _sync(device)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        all_layers()
        _sync(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    moved = 2 * args.tokens * args.layers * args.kv_heads * args.head_dim * pools[0].element_size()
    return {
        "bench": "rerope",
        "backend": backend,
        "mode": mode,
        "device": str(device),
        "dtype": args.dtype,
        "tokens": args.tokens,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "repeats": args.repeats,
        "median_ms_all_layers": round(med * 1e3, 4),
        "min_ms_all_layers": round(min(times) * 1e3, 4),
        "us_per_layer": round(med / args.layers * 1e6, 2),
        "effective_GBps": round(moved / med / 1e9, 3),
        "cpu_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)

    modes = ("per_layer_calls", "all_layers_call")
    for mode in modes:
        print(json.dumps(time_backend(args, "torch", torch.device("cpu"), mode)), flush=True)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "rerope", "backend": "triton", "skipped": "no CUDA device"}), flush=True)
        return
    cuda = torch.device("cuda")
    backends = ["torch"] + (["triton"] if triton_available() else [])
    for backend in backends:
        for mode in modes:
            print(json.dumps(time_backend(args, backend, cuda, mode)), flush=True)
    if "triton" not in backends:
        print(json.dumps({"bench": "rerope", "backend": "triton", "skipped": "triton is not importable"}), flush=True)


if __name__ == "__main__":
    main()
