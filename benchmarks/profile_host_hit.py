"""Where a tier hit's time goes, in process (no HTTP): a 4,096-token prompt is hit from host RAM, disk (its
files in the page cache) or Redis on loopback, and from the device pool, every hit computing the same 16 tokens
after 4,080 cached ones (255 whole blocks). Each hit's first-token time is split into the tiers' lookup and
read into the pool (fetch, which includes the copy of host RAM's blocks into the pool: load), the rest of the
admission, the forward, and the rest of the step; block_runs is how many runs of consecutive pool blocks the
sequence's block table makes (the forward after a load reads a table of one run, as after a device hit).

- host: a pool of 1.3 prompts with host RAM below it (as bench_tiers sizes it): the prompt is computed, two
  other prompts push it out into host RAM, it is hit from host RAM, then from the device pool.
- disk, redis: a first engine computes two prompts and writes them through to disk and Redis; a fresh engine
  on the same folder or Redis (as a restarted server, after one 64-token warm-up request) hits the first prompt
  from the tier (its first long request), then the second (a second tier hit), then the first again from the
  device pool.

    python -m benchmarks.profile_host_hit [--tier host disk redis] [--cprofile]

--cprofile prints each tier's first hit's profile (the top entries by own time)."""
from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.bench_tiers import warm_page_cache
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.server.launcher import redis_process

BS, LENGTH, CACHED = 16, 4096, 4080
spent: dict[str, float] = defaultdict(float)


def timed(obj, name: str, label: str) -> None:
    """Add the seconds each call of obj.name takes to spent[label]."""
    real = getattr(obj, name)

    @functools.wraps(real)
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    setattr(obj, name, call)


def instrument(engine) -> None:
    if engine.tiers is not None:
        timed(engine.tiers, "fetch", "fetch")
        timed(engine.tiers, "load", "load")
    timed(engine.blocks, "admit", "admit")
    timed(engine.runner, "run", "forward")
    real = engine.runner.run

    def run(slices, *args):
        table = slices[0].seq.block_table
        spent["block_runs"] = 1 + sum(b != a + 1 for a, b in zip(table, table[1:]))
        return real(slices, *args)

    engine.runner.run = run


def prompt(seed: int, n: int | None = None) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n or LENGTH)]


def tail(seed: int) -> list[int]:
    return [100 + seed * 16 + i for i in range(LENGTH - CACHED)]


def first_token(engine, request_id: str, ids: list[int]) -> float:
    engine.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0))
    start, first = time.perf_counter(), None
    while engine.has_work():
        outputs = engine.step()
        if first is None and any(o.new_token_ids for o in outputs):
            first = time.perf_counter() - start
    return first


def hit(engine, label: str, ids: list[int], profile: bool = False) -> None:
    spent.clear()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    seconds = first_token(engine, label, ids)
    if profiler:
        profiler.disable()
    parts = {k: spent[k] * 1e3 for k in ("fetch", "load", "admit", "forward") if k in spent}
    rest = seconds * 1e3 - parts.get("admit", 0) - parts.get("forward", 0)
    print(f"  {label:<22} first token {seconds * 1e3:7.1f} ms = admission {parts.get('admit', 0):6.1f} (tier fetch "
          f"{parts.get('fetch', 0):6.1f}, of which copy {parts.get('load', 0):5.1f}) + forward "
          f"{parts.get('forward', 0):6.1f} + rest {rest:5.1f}; block_runs {int(spent['block_runs'])}", flush=True)
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue()[:5000])


def host_hits(profile: bool) -> None:
    engine = build_engine(EngineConfig(num_gpu_blocks=int(1.3 * LENGTH / BS), cpu_cache_size=8 * 10**9,
                                       max_num_batched_tokens=8192, blend_key_shift=False))
    instrument(engine)
    first = prompt(0)
    first_token(engine, "cold", first)
    for i in range(2):
        first_token(engine, f"filler-{i}", prompt(10 + i))
    print("host")
    hit(engine, "host hit", first[:CACHED] + tail(1), profile)
    hit(engine, "device hit", first[:CACHED] + tail(2))


def tier_hits(tier: str, folder: str, redis_url: str, profile: bool) -> None:
    flags = dict(disk_cache_dir=folder) if tier == "disk" else dict(redis_url=redis_url)
    engine = build_engine(EngineConfig(kv_cache_memory=2 << 30, max_num_batched_tokens=8192, blend_key_shift=False,
                                       **flags))
    instrument(engine)
    print(tier)
    hit(engine, "warm-up (64 tokens)", prompt(99, 64))
    if tier == "disk":
        warm_page_cache(folder)
    hit(engine, f"{tier} hit (first)", prompt(0)[:CACHED] + tail(1), profile)
    hit(engine, f"{tier} hit (second)", prompt(1)[:CACHED] + tail(1))
    hit(engine, "device hit", prompt(0)[:CACHED] + tail(2))
    engine.close(5)


def main(argv: list[str] | None = None) -> None:
    global LENGTH, CACHED
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", nargs="+", choices=("host", "disk", "redis"), default=["host", "disk", "redis"])
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--length", type=int, default=4096,
                    help="prompt tokens (a multiple of 16; the hits compute its last 16)")
    args = ap.parse_args(argv)
    LENGTH, CACHED = args.length, args.length - BS
    if "host" in args.tier:
        host_hits(args.cprofile)
    others = [t for t in args.tier if t != "host"]
    if not others:
        return
    with tempfile.TemporaryDirectory(prefix="profile-tier-hit-") as folder, \
            redis_process(maxmemory="4gb") as (redis_url, _):
        writer = build_engine(EngineConfig(kv_cache_memory=2 << 30, max_num_batched_tokens=8192,
                                           blend_key_shift=False, disk_cache_dir=folder, redis_url=redis_url))
        for seed in (0, 1):
            first_token(writer, f"write-{seed}", prompt(seed))
        writer.close(300)
        del writer
        for tier in others:
            tier_hits(tier, str(Path(folder)), redis_url, args.cprofile)


if __name__ == "__main__":
    main()
