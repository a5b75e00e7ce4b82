"""Time the cache index: match and insert at 32k tokens over a 1M-token tree, hashing throughput,
and the replay of the shared Mooncake trace.

Prints one JSON line per measurement:

    python -m benchmarks.bench_radix [--repeats 50] [--trace ../shared/data/traces/conversation_trace.jsonl]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from radix import BlockHasher, RadixCache

BLOCK_SIZE = 16
PROMPT_TOKENS = 32_768
TREE_TOKENS = 1 << 20
SYSTEM_TOKENS = 2_048
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "conversation_trace.jsonl"


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def median_ms(samples_ns: list[int]) -> float:
    return round(statistics.median(samples_ns) / 1e6, 4)


def timed(fn) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def cache_prompt(cache: RadixCache, tokens: np.ndarray) -> None:
    m = cache.match(tokens)
    cache.lock(m.node)
    new = cache.allocate(len(tokens) // BLOCK_SIZE - len(m.block_ids))
    cache.insert(tokens, m.block_ids + new)
    cache.unlock(m.node)


def build_tree(rng: np.random.Generator) -> tuple[RadixCache, list[np.ndarray], list[np.ndarray]]:
    """At least 1M cached tokens: 32k-token prompts, each behind one of 4 shared 2k-token system prompts.

    The capacity leaves room for one more prompt only, so the insert benchmarks evict (untimed, in
    `allocate`) the least recently used prompts and the tree stays at about 1M tokens.
    """
    prompt_blocks = PROMPT_TOKENS // BLOCK_SIZE
    cache = RadixCache(TREE_TOKENS // BLOCK_SIZE + 2 * prompt_blocks, block_size=BLOCK_SIZE)
    systems = [rng.integers(0, 150_000, SYSTEM_TOKENS, dtype=np.int32) for _ in range(4)]
    prompts = []
    while cache.stats().cached_blocks * BLOCK_SIZE < TREE_TOKENS:
        body = rng.integers(0, 150_000, PROMPT_TOKENS - SYSTEM_TOKENS, dtype=np.int32)
        prompts.append(np.concatenate([systems[len(prompts) % 4], body]))
        cache_prompt(cache, prompts[-1])
    return cache, prompts, systems


def bench_match_insert(repeats: int) -> None:
    rng = np.random.default_rng(0)
    cache, prompts, systems = build_tree(rng)
    tree_tokens = cache.stats().cached_blocks * BLOCK_SIZE
    common = {"bench": "radix", "block_size": BLOCK_SIZE, "prompt_tokens": PROMPT_TOKENS, "tree_tokens": tree_tokens}

    hit = prompts[-1]
    half = np.concatenate([hit[: PROMPT_TOKENS // 2], rng.integers(0, 150_000, PROMPT_TOKENS // 2, dtype=np.int32)])
    miss = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32)
    assert cache.match(hit).num_tokens == PROMPT_TOKENS
    cases = {"match_full_hit": hit, "match_half_hit": half, "match_miss": miss}
    for name, tokens in cases.items():
        samples = [timed(lambda: cache.match(tokens)) for _ in range(repeats)]
        emit(**common, case=name, input="int32 array", median_ms=median_ms(samples))
    as_list = hit.tolist()
    samples = [timed(lambda: cache.match(as_list)) for _ in range(repeats)]
    emit(**common, case="match_full_hit", input="python list", median_ms=median_ms(samples))

    # Insert: a prompt whose 2,048 blocks are all new, and one behind a cached system prompt.
    for name, make in (
        ("insert_all_new", lambda: rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32)),
        ("insert_after_system_prompt", lambda: np.concatenate(
            [systems[0], rng.integers(0, 150_000, PROMPT_TOKENS - SYSTEM_TOKENS, dtype=np.int32)])),
    ):
        samples = []
        for _ in range(repeats):
            tokens = make()
            m = cache.match(tokens, record_stats=False)
            ids = m.block_ids + cache.allocate(PROMPT_TOKENS // BLOCK_SIZE - len(m.block_ids))
            samples.append(timed(lambda: cache.insert(tokens, ids)))
        emit(**common, case=name, new_blocks=PROMPT_TOKENS // BLOCK_SIZE - len(m.block_ids),
             median_ms=median_ms(samples), tree_tokens_after=cache.stats().cached_blocks * BLOCK_SIZE)
    cache.check_invariants(check_hashes=False)


def bench_fragmented_match(repeats: int) -> None:
    """A cached 32k-token prompt whose path is cut into many nodes (other prompts branch off it)."""
    rng = np.random.default_rng(2)
    prompt_blocks = PROMPT_TOKENS // BLOCK_SIZE
    for every in (64, 8, 1):  # a branch every `every` blocks
        cache = RadixCache(2 * prompt_blocks + prompt_blocks // every, block_size=BLOCK_SIZE)
        base = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32)
        cache_prompt(cache, base)
        for branch in range(every, prompt_blocks, every):
            other = base[: (branch + 1) * BLOCK_SIZE].copy()
            other[branch * BLOCK_SIZE] = 150_001  # diverges in the block after the branch point
            cache_prompt(cache, other)
        assert cache.match(base).num_tokens == PROMPT_TOKENS
        samples = [timed(lambda: cache.match(base)) for _ in range(repeats)]
        emit(bench="radix", block_size=BLOCK_SIZE, prompt_tokens=PROMPT_TOKENS, case="match_full_hit_fragmented",
             nodes_on_path=prompt_blocks // every, input="int32 array", median_ms=median_ms(samples))


def bench_hashing(repeats: int) -> None:
    tokens = np.random.default_rng(1).integers(0, 150_000, 131_072, dtype=np.int32)
    megabytes = tokens.nbytes / 1e6
    for algo in ("xxh3_128", "sha256"):
        for block_size in (16, 512):
            hasher = BlockHasher(block_size, algo=algo)
            samples = [timed(lambda: hasher.hash_blocks(tokens)) for _ in range(max(5, repeats // 5))]
            seconds = statistics.median(samples) / 1e9
            emit(bench="radix_hash", algo=algo, block_size=block_size, tokens=len(tokens),
                 median_ms=round(seconds * 1e3, 3), mb_per_s=round(megabytes / seconds, 1))


def bench_trace(path: Path, capacities: list[int | None]) -> None:
    if not path.exists():
        emit(bench="radix_trace_replay", skipped=f"trace not found: {path}")
        return
    from loadgen.simulate import load_trace, replay

    start = time.perf_counter()
    requests = load_trace(path)
    load_s = time.perf_counter() - start
    for capacity in capacities:
        start = time.perf_counter()
        result = replay(requests, block_size=512, capacity_blocks=capacity)
        emit(bench="radix_trace_replay", requests=result.requests, capacity_blocks=capacity,
             load_s=round(load_s, 3), replay_s=round(time.perf_counter() - start, 3),
             token_hit_rate=round(result.token_hit_rate, 4), block_hit_rate=round(result.block_hit_rate, 4),
             evicted_blocks=result.evicted_blocks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    args = parser.parse_args(argv)
    bench_match_insert(args.repeats)
    bench_fragmented_match(args.repeats)
    bench_hashing(args.repeats)
    bench_trace(args.trace, [None, 50_000, 20_000, 5_000, 1_000])


if __name__ == "__main__":
    main()
