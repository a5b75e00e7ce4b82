"""Two checkouts of the code in one run: each benchmark runs once from a checkout of the code before a change
and once from this one, alternating, so both see the same machine state. For a change that must not make
anything slower or worse (a restructure), this is the figure that counts; a figure from another hour on a
shared VM is not.

    .venv/bin/python -m benchmarks.bench_ab --before ../before-checkout [--benches ttft,engine,blend] [--rounds 2]
        [--weight-dtype auto|fp32|...|legacy]

The before checkout needs nothing installed: its packages are imported from its own folder (run from there,
Python finds them before the installed editable copy). Each benchmark is the checkout's own script, with the
arguments below. Prints every JSON line with `code` set to before/after and `round`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from reuse_server.server.openmp import with_short_spin

REPO = Path(__file__).resolve().parents[1]
ARGS = {
    "ttft": ["--lengths", "4096", "--warm-repeats", "3", "--servers", "1"],
    "engine": [],
    "blend": ["--cases", "100", "--ratios", "0.15"],
}


def run(checkout: Path, bench: str, extra: list[str]) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", f"benchmarks.bench_{bench}", *ARGS[bench], *extra], cwd=checkout,
                          env=with_short_spin(os.environ), capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
    rows = []
    for line in done.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path, help="a checkout of the code before the change")
    ap.add_argument("--benches", default="ttft,engine,blend")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--weight-dtype", default="auto",
                    help="both sides hold their weights so (a side from before --weight-dtype existed: 'legacy')")
    args = ap.parse_args(argv)
    for bench in args.benches.split(","):
        for r in range(args.rounds):
            order = [("before", args.before.resolve()), ("after", REPO)]
            if r % 2:
                order.reverse()  # neither side always runs first
            for code, checkout in order:
                # compare like with like; code from before --weight-dtype held fp32 only ('legacy': this side fp32)
                if args.weight_dtype == "legacy":
                    extra = ["--weight-dtype", "fp32"] if code == "after" else []
                else:
                    extra = ["--weight-dtype", args.weight_dtype]
                for row in run(checkout, bench, extra):
                    print(json.dumps({**row, "code": code, "round": r}), flush=True)


if __name__ == "__main__":
    main()
