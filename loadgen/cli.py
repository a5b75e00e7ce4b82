"""`reuse-loadgen`: one entry point, one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed args, returning an exit code). Errors a user can cause
raise `UsageError` and become one clear line on stderr with exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from loadgen.errors import UsageError

SUBCOMMAND_MODULES = ("loadgen.simulate", "loadgen.run", "loadgen.report_cmd", "loadgen.reclaim", "loadgen.aiperf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reuse-loadgen", description="Workloads, trace simulation and cache-reuse reports.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # subcommand not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"reuse-loadgen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
