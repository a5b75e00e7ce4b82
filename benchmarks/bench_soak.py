"""The soak of tests/test_soak.py, longer and on the bundled SmolLM2 by default (benchmarks/soak.py has the
traffic): many concurrent clients for --minutes, a fraction leaving at random points, then the pool checked
and a greedy probe compared with its answer from before.

Prints one JSON line: seed, duration, requests, completed, disconnects, errors, the request mix, leaked blocks
(KV blocks still in use once nothing runs; must be 0), whether free + evictable == total, evictions,
preemptions, blended tokens, and whether the probe's answer is unchanged.

    .venv/bin/python -m benchmarks.bench_soak [--minutes 10] [--clients 32] [--seed N] [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import random

from benchmarks.bench_ttft import server_process, served_model
from benchmarks.soak import probe, run_soak, settled_pool


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--leave-rate", type=float, default=0.25, help="share of requests the client leaves early")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--num-gpu-blocks", type=int, default=2048, help="a small pool, so eviction happens")
    ap.add_argument("--max-prompt-words", type=int, default=600)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(json.dumps({"seed": seed}), flush=True)
    with server_process("--model", args.model, "--num-gpu-blocks", str(args.num_gpu_blocks), "--blend") as (url, _):
        model = served_model(url)
        before = probe(url, model)
        result = run_soak(url, model, args.minutes * 60, args.clients, seed, args.leave_rate,
                          max_prompt_words=args.max_prompt_words)
        pool = settled_pool(url, timeout=120)
        same = probe(url, model) == before
    print(json.dumps({**result.summary(), "first_errors": result.errors[:5], "leaked_blocks": pool["in_use"],
                      "free_plus_evictable_is_total": pool["free"] + pool["evictable"] == pool["kv_blocks_total"],
                      "evicted_blocks": pool["evicted_blocks_total"], "preemptions": pool["preemptions_total"],
                      "blended_tokens": pool["blended_tokens_total"], "probe_unchanged": same}), flush=True)


if __name__ == "__main__":
    main()
