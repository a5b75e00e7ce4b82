"""`reuse-loadgen simulate`: how much prefix cache would my traffic need?

Replays a Mooncake-format trace (one JSON object a line: `timestamp`, `input_length`,
`output_length`, `hash_ids`, one id per 512-token block) through the real `radix.RadixCache`.

Model:
- each hash id stands for one deterministic synthetic block of 512 tokens (derived from the id), so
  two requests share tokens exactly where the trace says they share blocks; the cache's own block
  size may differ from 512 (the prompt is cut again; below 512, the full cache blocks inside a
  request's partial last trace block are shared only with requests that carry the same id there);
- requests run one at a time in timestamp order (ties keep file order): match (counted in the
  stats), lock the matched path, allocate blocks for the rest (evicting leaves by policy if the
  capacity is reached), publish them as the engine's block manager does (radix's `publish`: insert,
  move the lock to the chain's end), and release the lock when the request ends, i.e. at once;
- only full blocks are cached: a request's partial last block always misses.

Output: one JSON object for one capacity (none = unlimited: enough blocks that nothing is ever
evicted). For a comma-separated list of capacities, one JSON object `{"curve": [...]}` holding one
such object per capacity, plus a human-readable table on stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loadgen.errors import UsageError
from radix import POLICIES, TOKEN_DTYPE, RadixCache, check_block_size, publish

TRACE_BLOCK_TOKENS = 512  # Mooncake traces give one hash id per 512 tokens
_MAX_HASH_ID = 2**62  # a synthetic block stores the id in two int32 tokens
_UNLIMITED_WORDS = ("unlimited", "none", "inf")


@dataclass(frozen=True)
class TraceRequest:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass
class ReplayResult:
    capacity_blocks: int | None  # None: unlimited
    block_size: int
    policy: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_rate: float
    prompt_blocks: int  # every block of every prompt, partial last blocks included
    hit_blocks: int
    block_hit_rate: float
    evicted_blocks: int
    cached_blocks: int  # blocks held by the cache at the end of the replay
    replay_seconds: float


# ---------------------------------------------------------------- trace file


def _field(record: dict, name: str, kind: type, where: str):
    if name not in record:
        raise UsageError(f"{where}: missing field {name!r}")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise UsageError(f"{where}: field {name!r} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if value < 0:
        raise UsageError(f"{where}: field {name!r} must not be negative, got {value!r}")
    return value


def parse_trace_line(text: str, line: int, source: str = "trace") -> TraceRequest | None:
    """One trace line as a request (None for a blank line); UsageError naming the line if malformed."""
    where = f"{source}: line {line}"
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
    timestamp = _field(record, "timestamp", (int, float), where)
    input_length = _field(record, "input_length", int, where)
    output_length = _field(record, "output_length", int, where)
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < _MAX_HASH_ID for h in hash_ids
    ):
        raise UsageError(f"{where}: field 'hash_ids' must be a list of non-negative integers")
    expected = math.ceil(input_length / TRACE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise UsageError(
            f"{where}: input_length {input_length} needs {expected} hash_ids "
            f"(one per {TRACE_BLOCK_TOKENS} tokens), got {len(hash_ids)}"
        )
    return TraceRequest(line, float(timestamp), input_length, output_length, tuple(hash_ids))


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake trace and return its requests in timestamp order (ties in file order)."""
    path = Path(path)
    requests = []
    try:
        with path.open(encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                request = parse_trace_line(text, number, str(path))
                if request is not None:
                    requests.append(request)
    except OSError as exc:
        raise UsageError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not requests:
        raise UsageError(f"{path}: the trace holds no requests")
    requests.sort(key=lambda r: r.timestamp)  # stable: ties keep file order
    return requests


# -------------------------------------------------------------------- replay


def synthetic_prompt(hash_ids: tuple[int, ...], input_length: int) -> np.ndarray:
    """Deterministic tokens for a trace request: block j of 512 tokens encodes hash_ids[j]."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    blocks = np.empty((len(ids), TRACE_BLOCK_TOKENS), dtype=TOKEN_DTYPE)
    blocks[:, 2:] = np.arange(2, TRACE_BLOCK_TOKENS, dtype=TOKEN_DTYPE)
    blocks[:, 0] = ids & 0x7FFFFFFF
    blocks[:, 1] = ids >> 31
    return blocks.reshape(-1)[:input_length]


def replay(
    requests: list[TraceRequest],
    block_size: int = TRACE_BLOCK_TOKENS,
    capacity_blocks: int | None = None,
    policy: str = "lru",
) -> ReplayResult:
    """Run `requests` through a `RadixCache` of `capacity_blocks` blocks (None: unlimited)."""
    block_size = check_block_size(block_size)
    full_blocks = [r.input_length // block_size for r in requests]
    if capacity_blocks is None:
        num_blocks = sum(full_blocks)  # every block of the trace fits: nothing is ever evicted
    else:
        if capacity_blocks < 1:
            raise UsageError(f"capacity must be at least 1 block, got {capacity_blocks}")
        biggest = max(range(len(requests)), key=full_blocks.__getitem__)
        if full_blocks[biggest] > capacity_blocks:
            raise UsageError(
                f"capacity of {capacity_blocks} blocks is smaller than one request: the request on line "
                f"{requests[biggest].line} needs {full_blocks[biggest]} blocks of {block_size} tokens"
            )
        num_blocks = capacity_blocks
    cache = RadixCache(num_blocks, block_size=block_size, policy=policy)

    started = time.perf_counter()
    for request, n_full in zip(requests, full_blocks):
        tokens = synthetic_prompt(request.hash_ids, request.input_length)
        matched = cache.match(tokens)
        cache.lock(matched.node)  # allocating must not evict what it matched
        new_blocks = cache.allocate(n_full - len(matched.block_ids))
        # ...the request prefills here; its computed blocks go into the tree as the engine files them...
        published = publish(cache, tokens, matched.block_ids + new_blocks, b"", held=matched.node)
        # ...and decodes; in this model it ends at once
        cache.unlock(published.node)
    seconds = time.perf_counter() - started

    stats = cache.stats()
    prompt_tokens = sum(r.input_length for r in requests)
    prompt_blocks = sum(math.ceil(r.input_length / block_size) for r in requests)
    hit_blocks = stats.hit_tokens // block_size
    return ReplayResult(
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        policy=cache.policy.name,
        requests=len(requests),
        prompt_tokens=prompt_tokens,
        hit_tokens=stats.hit_tokens,
        token_hit_rate=stats.hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        prompt_blocks=prompt_blocks,
        hit_blocks=hit_blocks,
        block_hit_rate=hit_blocks / prompt_blocks if prompt_blocks else 0.0,
        evicted_blocks=stats.evicted_blocks,
        cached_blocks=stats.cached_blocks,
        replay_seconds=round(seconds, 3),
    )


# ----------------------------------------------------------------------- CLI


def parse_capacities(text: str | None) -> list[int | None]:
    """'1000,5000,unlimited' -> [1000, 5000, None]; None (flag absent) -> [None]."""
    if text is None:
        return [None]
    capacities: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part.lower() in _UNLIMITED_WORDS:
            capacities.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"--capacity-blocks: {part!r} is not a whole number of blocks (or 'unlimited')") from None
        if value < 1:
            raise UsageError(f"--capacity-blocks: capacity must be at least 1 block, got {value}")
        capacities.append(value)
    return capacities


def format_table(results: list[ReplayResult]) -> str:
    rows = [f"{'capacity (blocks)':>18} {'token hit rate':>15} {'block hit rate':>15} {'evicted blocks':>15}"]
    for r in results:
        capacity = "unlimited" if r.capacity_blocks is None else f"{r.capacity_blocks:,}"
        rows.append(f"{capacity:>18} {r.token_hit_rate:>15.4f} {r.block_hit_rate:>15.4f} {r.evicted_blocks:>15,}")
    return "\n".join(rows)


def run_simulate(args: argparse.Namespace) -> int:
    try:
        block_size = check_block_size(args.block_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    capacities = parse_capacities(args.capacity_blocks)
    requests = load_trace(args.trace)
    results = [replay(requests, block_size, capacity, args.policy) for capacity in capacities]
    if args.capacity_blocks is not None and "," in args.capacity_blocks:
        print(json.dumps({"curve": [asdict(r) for r in results]}))
        print(format_table(results), file=sys.stderr)
    else:
        print(json.dumps(asdict(results[0])))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a Mooncake trace through the radix cache: hit rate for a given cache capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--block-size", type=int, default=TRACE_BLOCK_TOKENS,
                        help="cache block size in tokens, a power of two from 1 to 512 (default 512)")
    parser.add_argument("--capacity-blocks", default=None,
                        help="cache capacity in blocks; a comma list (e.g. 1000,5000,unlimited) prints a curve; "
                             "default unlimited")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="lru", help="eviction policy (default lru)")
    parser.set_defaults(func=run_simulate)
