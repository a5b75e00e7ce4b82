"""Each KV tier's read path against its own ceiling on this machine, in one process, without a server: the
blocks of a --length-token prompt of the bundled model (fp32 KV) are read from host RAM, disk (files in the
page cache) and Redis on loopback into a KV pool, as an admission reads them: KVTiers.fetch into the pool
blocks it took (disk files and Redis values land straight in them; host RAM's are copied in). "first read" is
the tier's first read in the process (a fresh server's first hit pays what it costs once); the others are the
best of --repeat. The path through the tier's read buffer (fetch, then .load: a copy) is timed too: it is what a
pool that cannot take reads in place gets (an 8-bit pool's scales, another tier dtype, a hybrid model's pool).

Ceilings: a torch copy of the same bytes into memory already touched (what host RAM can do at best), the
xxh3-128 checksum on one core, reading the same files into one buffer with os.readv (disk), redis-benchmark
GET of values of the same size on one connection (Redis). Each figure is the best of --repeat runs.

    .venv/bin/python -m benchmarks.bench_tier_reads [--length 4096] [--repeat 5]

One JSON line per measurement (benchmarks/results/bench_tier_reads.jsonl keeps them)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import torch
import xxhash

from benchmarks.bench_ttft import emit
from reuse_server.kv.pool import KVPool
from reuse_server.kv.tiers import BlobContext, DiskTier, HostTier, KVTiers, RedisTier
from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.manager import Wanted
from reuse_server.server.launcher import redis_process


def best(fn, repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - start)
    return out


def geometry(model: str) -> tuple[int, int, int]:
    from reuse_server.model.loader import resolve_model

    config = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"], heads, head_dim


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args(argv)
    layers, heads, head_dim = geometry(args.model)
    bs = 16
    n = args.length // bs
    pool = KVPool(layers, 2 * n + 1, bs, heads, head_dim, torch.float32)
    pool._data.normal_()  # noqa: SLF001 (what the blocks hold does not matter; their pages must be touched)
    layout = pool.layout
    ctx = BlobContext("ab" * 16, bs, "xxh3_128", layout.describe(), layout.nbytes)
    kv = pool.export_blocks(list(range(n)))
    hashes = [os.urandom(16) for _ in range(n)]
    entries = [BlockEntry(h, hashes[i - 1] if i else b"\0" * 16, os.urandom(4 * bs), b"", kv[i])
               for i, h in enumerate(hashes)]
    wanted = [Wanted(i, e.hash, e.parent_hash, e.tokens) for i, e in enumerate(entries)]
    into_blocks = list(range(n, 2 * n))
    total = kv.numel()
    common = dict(length=args.length, blocks=n, mb=round(total / 1e6, 1))

    def row(case: str, seconds: float, **extra) -> None:
        emit(bench="tier_reads", case=case, ms=round(seconds * 1e3, 2), gb_s=round(total / seconds / 1e9, 2),
             **common, **extra)

    warm = torch.empty_like(kv)
    row("ceiling: torch copy", best(lambda: warm.copy_(kv), args.repeat))
    row("ceiling: xxh3-128, one core", best(lambda: xxhash.xxh3_128_digest(kv.numpy()), args.repeat))

    def read_path(tiers: KVTiers, tier: str) -> None:
        into = {w.index: n + w.index for w in wanted}
        start = time.perf_counter()
        assert len(tiers.fetch(wanted, contiguous=True, into=into)) == n
        first = time.perf_counter() - start
        direct = best(lambda: tiers.fetch(wanted, contiguous=True, into=into), args.repeat)
        assert torch.equal(pool.export_blocks(into_blocks), kv)
        row(f"{tier}: fetch into the pool (first read)", first)
        row(f"{tier}: fetch into the pool", direct)
        pool._data[:, :, n:].zero_()
        start = time.perf_counter()
        tiers.load(into_blocks, [f for _, f in sorted(tiers.fetch(wanted, True).items())])
        row(f"{tier}: fetch into the read buffer + load (first read)", time.perf_counter() - start)
        fetch = best(lambda: tiers.fetch(wanted, contiguous=True), args.repeat)
        found = tiers.fetch(wanted, contiguous=True)
        assert len(found) == n, f"{tier}: {len(found)} of {n} blocks found"
        ordered = [found[i] for i in range(n)]
        load = best(lambda: tiers.load(into_blocks, ordered), args.repeat)
        both = best(lambda: tiers.load(into_blocks, [f for _, f in sorted(tiers.fetch(wanted, True).items())]),
                    args.repeat)
        assert torch.equal(pool.export_blocks(into_blocks), kv)
        row(f"{tier}: fetch into the read buffer (read, check)", fetch)
        row(f"{tier}: load (copy from the read buffer into the pool)", load)
        row(f"{tier}: fetch into the read buffer + load", both)

    host = HostTier(4 * total)
    host.put(entries)
    read_path(KVTiers(pool, host=host), "host")
    with tempfile.TemporaryDirectory(prefix="bench-tier-reads-") as folder:
        disk = DiskTier(Path(folder), 4 * total, ctx)
        disk.put(entries)
        disk.close(120)
        disk = DiskTier(Path(folder), 4 * total, ctx)  # a restart: the index from the folder
        paths = [disk._path(h) for h in hashes]  # noqa: SLF001
        size = os.path.getsize(paths[0])
        files = torch.empty((n, size), dtype=torch.uint8)

        def readv() -> None:
            for p, dst in zip(paths, files.numpy()):
                fd = os.open(p, os.O_RDONLY)
                os.readv(fd, [dst])
                os.close(fd)

        row("ceiling: disk, os.readv of the files into one buffer", best(readv, args.repeat))
        read_path(KVTiers(pool, disk=disk), "disk (page cache)")
    with redis_process(maxmemory="4gb") as (url, _):
        remote = RedisTier(url, ctx, timeout=5)
        remote.put(entries)
        remote.close(120)
        remote = RedisTier(url, ctx, timeout=5)
        port = url.rsplit(":", 1)[1].split("/")[0]
        csv = subprocess.run(["redis-benchmark", "-p", port, "-t", "set,get", "-d", str(size), "-n", "400", "-c", "1",
                              "--csv"], capture_output=True, text=True, check=True).stdout
        rps = next(float(line.split(",")[1].strip('"')) for line in csv.splitlines() if line.startswith('"GET"'))
        row("ceiling: redis-benchmark GET, one connection", n / rps, value_bytes=size)
        client = redis.Redis.from_url(url)
        keys = [remote.key(h) for h in hashes]
        row("redis-py MGET of 32 keys (bytes objects)",
            best(lambda: [client.mget(keys[i:i + 32]) for i in range(0, n, 32)], args.repeat))
        read_path(KVTiers(pool, remote=remote), "redis")


if __name__ == "__main__":
    main()
