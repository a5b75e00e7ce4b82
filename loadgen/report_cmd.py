"""`reuse-loadgen report DIR`: re-render report.md and the plots from DIR/report.json."""
from __future__ import annotations

import json
from pathlib import Path

from loadgen.errors import UsageError
from loadgen.render import render_outputs
from loadgen.report import load_json


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="re-render report.md and plots from DIR/report.json",
                              description="Re-render DIR/report.md and the PNG plots from DIR/report.json.")
    p.add_argument("dir", type=Path, help="a directory written by `reuse-loadgen run`")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=main)


def main(args) -> int:
    path = args.dir / "report.json"
    if not path.is_file():
        raise UsageError(f"{path}: no such file (run `reuse-loadgen run --out {args.dir}` first)")
    try:
        report = load_json(args.dir)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("workloads"), dict):
        raise UsageError(f"{path}: not a loadgen report (no \"workloads\" object)")
    try:
        written = render_outputs(report, args.dir, with_plots=not args.no_plots)
    except (KeyError, TypeError) as exc:
        raise UsageError(f"{path}: a workload entry lacks a field the report needs ({exc})") from None
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
