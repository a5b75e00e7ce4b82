"""NVIDIA aiperf against our server: its synthetic run and a replay of the shared production trace (Mooncake
format, prompts sharing prefixes by `hash_ids`), with the prefix cache on and off, each beside the server's
own hit counters. One server per setting, the bundled model, `reuse-loadgen aiperf` doing the driving.

    python -m benchmarks.bench_aiperf            # --requests 32 --concurrency 2 --max-blocks 8 --block-tokens 128

Needs `make aiperf` (aiperf in `.venv-aiperf`, its own dependency pins).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.bench_ttft import server_process
from loadgen.cli import build_parser
from loadgen.aiperf import run_all, table
from reuse_server.model.loader import resolve_model

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-blocks", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--runs", default="synthetic,trace")
    ap.add_argument("--settings", default="cache,no-cache", help="comma list of cache, no-cache")
    ap.add_argument("--out-dir", default=str(REPO / "out" / "bench-aiperf"))
    args = ap.parse_args(argv)
    tokenizer_dir = resolve_model(None)  # the bundled model's converted folder holds its tokenizer files
    for setting in args.settings.split(","):
        serve = ["--max-num-batched-tokens", "8192"] + (["--no-prefix-cache"] if setting == "no-cache" else [])
        with server_process(*serve) as (url, _):
            loadgen_args = build_parser().parse_args([
                "aiperf", "--url", url, "--tokenizer-dir", str(tokenizer_dir), "--runs", args.runs,
                "--requests", str(args.requests), "--concurrency", str(args.concurrency),
                "--max-blocks", str(args.max_blocks), "--block-tokens", str(args.block_tokens),
                "--output-tokens", str(args.output_tokens), "--out-dir", str(Path(args.out_dir) / setting)])
            rows = [{"setting": setting, **row} for row in run_all(loadgen_args)]
        for row in rows:
            print(json.dumps(row), flush=True)
        print(f"{setting}:\n{table(rows)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
