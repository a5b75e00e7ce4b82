"""`reuse-loadgen run`: drive a server with workloads and write the report.

Each workload runs as its own phase (and, with --compare, a second baseline phase with caching
off), with the server's /metrics read before and after, so every number in the report has the
server's own count over the same window beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import sys
import uuid
from pathlib import Path

import httpx
from tqdm import tqdm

from loadgen.client import BASELINE, CacheMode, LoadClient, discover_model, normalize_server_url
from loadgen.errors import UsageError
from loadgen.metrics_scrape import counter_deltas, scrape
from loadgen.replica_metrics import replica_report, scrape_replicas
from loadgen.render import render_outputs
from loadgen.report import DEFAULT_MODEL_PARAMS, summarize, workload_entry, write_json
from loadgen.runner import PhaseResult, run_phase
from loadgen.workloads import (LIVE_BUILDERS, WORKLOAD_NAMES, Workload, WorkloadConfig, build_workload,
                               parse_workload_names)
from loadgen.workloads.spec import RequestSpec, Session


def bounded_number(kind, description: str, ok):
    """An argparse type: `kind(text)` that satisfies `ok`, else one clear message."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {description}, got {text!r}")
        return value
    return parse


positive_int = bounded_number(int, "a positive integer", lambda v: v >= 1)
non_negative_int = bounded_number(int, "a non-negative integer", lambda v: v >= 0)
positive_float = bounded_number(float, "a positive number", lambda v: v > 0)  # also rejects nan


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="drive a server with workloads and write a hit-rate report",
        description="Drive an OpenAI-compatible server with cache-reuse workloads and write DIR/report.json, "
                    "DIR/report.md and plots. Workloads: " + ", ".join(WORKLOAD_NAMES) + " (or all), and "
                    + ", ".join(LIVE_BUILDERS) + " (a real agent framework; only by name).")
    p.add_argument("--server", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, help="comma-separated workload names, or all")
    p.add_argument("--out", required=True, type=Path, help="directory for report.json, report.md and plots")
    p.add_argument("--requests", type=positive_int, default=48, help="requests per workload (default 48)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="sessions in flight at once (default 4)")
    p.add_argument("--duration", type=positive_float, default=300.0,
                   help="seconds per workload phase after which nothing new is sent (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed for every prompt (default 0)")
    p.add_argument("--compare", action="store_true",
                   help="run every workload a second time with prefix caching and blending off, as the baseline")
    p.add_argument("--baseline-server", help="run the baseline against this URL instead (implies --compare)")
    p.add_argument("--model", help="model id to request (default: the first one /v1/models lists)")
    p.add_argument("--output-tokens", type=positive_int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=4096,
                   help="keep every prompt under this many (estimated) tokens (default 4096)")
    p.add_argument("--chars-per-token", type=positive_float, default=4.0,
                   help="characters per token for the prompt-size estimate (default 4, English BPE)")
    p.add_argument("--agents", type=positive_int, default=4, help="agent-loop: agents (default 4)")
    p.add_argument("--turns", type=positive_int,
                   help="agent-loop, multi-turn: turns per session at most; agent-sdk*, anthropic-tools: steps per task "
                        "(default 12); agent-replay-*: user turns of the recorded session (default 5)")
    p.add_argument("--sessions", type=positive_int,
                   help="agent-replay-*: sessions replayed, --concurrency of them at once (default: --concurrency)")
    p.add_argument("--keep-recording", type=Path, metavar="PATH",
                   help="agent-replay-*: also write the recorded requests (JSON lines) to PATH, outside the checkout")
    p.add_argument("--system-tokens", type=positive_int, default=800,
                   help="agent-loop: system prompt with tool definitions; agent-sdk: the instructions (default 800)")
    p.add_argument("--tool-output-tokens", type=positive_int, default=120,
                   help="agent-loop, agent-sdk: tool output tokens per step (default 120)")
    p.add_argument("--docs-file", type=Path,
                   help="rag-shuffle, shared-doc: text, one document per line (default ../shared/data/docs/lee_background.cor)")
    p.add_argument("--doc-tokens", type=positive_int, default=1024,
                   help="shared-doc, long-doc-qa: document length; rag-shuffle: each document at most (default 1024)")
    p.add_argument("--documents", type=positive_int, default=12,
                   help="long-doc-qa: distinct documents, asked once in order, then in shuffled rounds up to "
                        "--requests (default 12; --requests 36 asks each twice more)")
    p.add_argument("--rag-k", type=positive_int, default=4, help="rag-shuffle: documents per request (default 4)")
    p.add_argument("--rag-pool", type=positive_int, default=16, help="rag-shuffle: documents to draw from (default 16)")
    p.add_argument("--return-fraction", type=fraction, default=0.5,
                   help="multi-turn: share of users who leave half-way and come back last (default 0.5)")
    p.add_argument("--trace-file", type=Path,
                   help="trace: Mooncake JSONL (default ../shared/data/traces/conversation_trace.jsonl)")
    p.add_argument("--trace-block-tokens", type=positive_int, default=512,
                   help="trace: tokens per hash id (default 512 as in the trace; smaller for small models)")
    p.add_argument("--vocab-size", type=positive_int, default=49152,
                   help="trace: token ids are drawn below this (default 49152, SmolLM2)")
    p.add_argument("--time-scale", type=non_negative_float, default=0.0,
                   help="trace: arrival times x this (1 = real time, 0 = no pacing; default 0)")
    p.add_argument("--kv-blend", choices=("server", "on", "off"), default="server",
                   help="ask for non-prefix reuse in the cached phase (default: the server's setting)")
    p.add_argument("--recompute-ratio", type=fraction, help="with --kv-blend on: share of reused tokens to recompute")
    p.add_argument("--cache-salt", default="auto",
                   help="cache_salt per workload: auto (fresh per run, so runs and workloads do not share cache), "
                        "none, or a fixed string")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="uncounted requests before the first phase (default 2)")
    p.add_argument("--request-timeout", type=positive_float, default=300.0, help="seconds per request (default 300)")
    p.add_argument("--model-params", type=positive_float, default=DEFAULT_MODEL_PARAMS,
                   help="parameters of the served model, for prefill FLOPs = 2 x params x tokens (default 134.5e6)")
    p.add_argument("--replica-metrics", nargs="+", default=[], metavar="URL",
                   help="base URLs of the replicas behind --server (a gateway): their /metrics are read around each "
                        "phase for per-replica requests, hit rate and TTFT, and their spread")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def workload_config(args) -> WorkloadConfig:
    return WorkloadConfig(
        seed=args.seed, requests=args.requests, output_tokens=args.output_tokens, max_prompt_tokens=args.max_prompt_tokens,
        chars_per_token=args.chars_per_token, agents=args.agents, turns=args.turns or 12, system_tokens=args.system_tokens,
        tool_output_tokens=args.tool_output_tokens, docs_file=args.docs_file, doc_tokens=args.doc_tokens, rag_k=args.rag_k,
        rag_pool=args.rag_pool, documents=args.documents, return_fraction=args.return_fraction, trace_file=args.trace_file,
        trace_block_tokens=args.trace_block_tokens, vocab_size=args.vocab_size, time_scale=args.time_scale,
        sessions=args.sessions or args.concurrency, replay_turns=args.turns or 5, keep_recording=args.keep_recording)


def cache_salt_base(arg: str) -> str | None:
    if arg == "none":
        return None
    if arg == "auto":
        return f"loadgen-{uuid.uuid4().hex[:12]}"
    return arg


def cached_mode(args, salt: str | None) -> CacheMode:
    blend = {"server": None, "on": True, "off": False}[args.kv_blend]
    return CacheMode(prefix_cache=True, kv_blend=blend, recompute_ratio=args.recompute_ratio, cache_salt=salt)


def prepare_out_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot create the directory ({exc.strerror})") from None
    if not path.is_dir():
        raise UsageError(f"--out {path}: not a directory")
    return path


def warmup_sessions(count: int, max_tokens: int) -> list[Session]:
    return [Session(id=f"warmup{i}", requests=[RequestSpec(
        session=f"warmup{i}", turn=0, max_tokens=min(4, max_tokens),
        messages=({"role": "user", "content": f"Warm-up request {i}: say hello."},))]) for i in range(count)]


async def _phase(label: str, workload: Workload, server: str, model: str, mode: CacheMode, args,
                 http: httpx.AsyncClient) -> tuple[PhaseResult, dict, dict | None]:
    replicas = args.replica_metrics
    before = await scrape(http, server)
    replicas_before = await scrape_replicas(http, replicas)
    client = LoadClient(server, model, mode, timeout_s=args.request_timeout, seed=args.seed)
    total = workload.planned_requests
    try:
        with tqdm(total=total, desc=f"{workload.name} ({label})", unit="req", file=sys.stderr,
                  disable=True if args.no_progress else None, dynamic_ncols=True) as bar:
            result = await run_phase(workload.sessions, client, args.concurrency, args.duration, bar)
    finally:
        await client.close()
    after = await scrape(http, server)
    replicas_after = await scrape_replicas(http, replicas)
    per_replica = replica_report(replicas, replicas_before, replicas_after) if replicas else None
    return result, counter_deltas(before, after), per_replica


async def drive(workloads: list[Workload], server: str, model: str, baseline_server: str | None,
                baseline_model: str | None, args, flops_per_token: float, records: list[dict]) -> dict:
    """Runs every phase; appends one record per request to `records`; returns the report's workload entries."""
    salt = cache_salt_base(args.cache_salt)
    entries: dict[str, dict] = {}
    async with httpx.AsyncClient(timeout=10.0) as http:
        if args.warmup:
            warm = LoadClient(server, model, BASELINE, timeout_s=args.request_timeout)
            try:
                await run_phase(warmup_sessions(args.warmup, args.output_tokens), warm, args.concurrency, args.duration)
            finally:
                await warm.close()
        for wl in workloads:
            mode = cached_mode(args, f"{salt}/{wl.name}" if salt else None)
            cached, cached_metrics, cached_replicas = await _phase("cached", wl, server, model, mode, args, http)
            summary = summarize(cached.results, cached.wall_s, flops_per_token, cached.unsent)
            records.extend({"workload": wl.name, "phase": "cached", **r.to_dict()} for r in cached.results)
            if baseline_server is not None:
                base, base_metrics, _ = await _phase("baseline", wl, baseline_server, baseline_model, BASELINE, args, http)
                records.extend({"workload": wl.name, "phase": "baseline", **r.to_dict()} for r in base.results)
                entries[wl.name] = workload_entry(summary, cached_metrics,
                                                  summarize(base.results, base.wall_s, flops_per_token, base.unsent), base_metrics)
            else:
                entries[wl.name] = workload_entry(summary, cached_metrics)
            if cached_replicas is not None:
                entries[wl.name]["replicas"] = cached_replicas
    return entries


def served_model(server: str, args) -> str:
    """The model id to request; checks that the prompt budget fits the server's context when it says."""
    served = discover_model(server)
    if served.max_model_len is not None and args.max_prompt_tokens + args.output_tokens > served.max_model_len:
        raise UsageError(f"--max-prompt-tokens {args.max_prompt_tokens} + --output-tokens {args.output_tokens} exceed "
                         f"the context of {served.id} at {server} ({served.max_model_len} tokens)")
    return args.model or served.id


def write_requests(records: list[dict], out_dir: Path) -> Path:
    path = out_dir / "requests.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return path


def _jsonable(value):
    return str(value) if isinstance(value, Path) else value


def main(args) -> int:
    names = parse_workload_names(args.workload)
    args.replica_metrics = [normalize_server_url(url) for url in args.replica_metrics]
    if args.recompute_ratio is not None and args.kv_blend != "on":
        raise UsageError("--recompute-ratio needs --kv-blend on")
    server = normalize_server_url(args.server)
    baseline_server = normalize_server_url(args.baseline_server) if args.baseline_server else (server if args.compare else None)
    config = workload_config(args)
    workloads = [build_workload(name, config) for name in names]  # bad sizes and missing files fail before any traffic
    model = served_model(server, args)
    baseline_model = None
    if baseline_server is not None:
        baseline_model = model if baseline_server == server else served_model(baseline_server, args)
    out_dir = prepare_out_dir(args.out)
    context = discover_model(server).max_model_len
    for wl in workloads:  # before any phase: agent-replay records its agent against the server here
        wl.prepare(server, model, context)
    flops_per_token = 2.0 * args.model_params
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    records: list[dict] = []
    entries = asyncio.run(drive(workloads, server, model, baseline_server, baseline_model, args, flops_per_token, records))
    report = {
        "meta": {
            "server": server, "model": model, "started_at": started, "seed": args.seed, "concurrency": args.concurrency,
            "requests_per_workload": args.requests, "duration_s_per_phase": args.duration,
            "baseline": (None if baseline_server is None else
                         f"same workloads with prefix_cache off and kv_blend off, against {baseline_server}"),
            "kv_blend": args.kv_blend, "model_params": args.model_params, "flops_per_token": flops_per_token,
            "replica_metrics": args.replica_metrics,
            "config": {k: _jsonable(v) for k, v in dataclasses.asdict(config).items()},
        },
        "workloads": entries,
    }
    write_json(report, out_dir)
    write_requests(records, out_dir)
    written = render_outputs(report, out_dir, with_plots=not args.no_plots)
    for name, w in entries.items():
        hit = "n/a" if w["prefix_hit_rate"] is None else f"{100 * w['prefix_hit_rate']:.1f}%"
        ttft = w["ttft_ms"]["p50"]
        line = f"{name}: {w['requests']} requests, {w['errors']} errors, prefix hit rate {hit}, " \
               f"TTFT p50 {'n/a' if ttft is None else f'{ttft:.1f} ms'}"
        if "speedup" in w and w["speedup"]["ttft_p50"] is not None:
            line += f" ({w['speedup']['ttft_p50']:.2f}x vs baseline)"
        requests = ((w.get("replicas") or {}).get("spread") or {}).get("requests")
        if requests is not None:
            line += ", requests per replica " + " / ".join(f"{r:.0f}" for r in requests)
        print(line)
    print(f"wrote {out_dir / 'report.json'}, {out_dir / 'requests.jsonl'}, " + ", ".join(str(p) for p in written))
    errors = sum(w["errors"] + (w.get("baseline") or {}).get("errors", 0) for w in entries.values())
    if errors:
        print(f"reuse-loadgen run: {errors} requests failed (see the Errors section of report.md)", file=sys.stderr)
        return 1
    return 0
