"""`reuse-loadgen aiperf`: NVIDIA's aiperf drives the server, and the server's own hit counters stand beside it.

aiperf is the load generator people publish serving benchmarks with; a run of it against this server is a
figure a reader can reproduce with a tool they already trust. Two runs:
- `synthetic`: aiperf's own prompts (no shared prefixes beyond its prefix pool), a baseline;
- `trace`: a Mooncake-format trace (`timestamp`, `input_length`, `output_length`, `hash_ids`: one id per block
  of prompt, equal ids = equal text) replayed through aiperf's `mooncake_trace` dataset, whose prompts share
  prefixes exactly where the trace's requests did.

Offline, aiperf loads a tokenizer only by hub name from the Hugging Face cache (a folder path fails its repo-id
check, and `builtin` downloads tiktoken's table), so the served model's tokenizer files are laid out as a hub
cache entry in a private HF_HOME and aiperf runs with HF_HUB_OFFLINE=1. aiperf pins its own dependencies, so it
lives in a virtual environment of its own (`make aiperf` builds `.venv-aiperf`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx

from loadgen.errors import UsageError
from loadgen.metrics_scrape import parse_counters

DEFAULT_AIPERF = Path(__file__).resolve().parents[1] / ".venv-aiperf" / "bin" / "aiperf"
HUB_NAME = "local/served-tokenizer"  # any repo-shaped name: it only keys the cache entry we write
SNAPSHOT = "0" * 40
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def lay_hub_cache(tokenizer_dir: Path, hf_home: Path, name: str = HUB_NAME) -> str:
    """Copy a tokenizer folder into `hf_home` as the hub cache entry `name` (refs/main -> one snapshot)."""
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file() and not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise UsageError(f"{tokenizer_dir} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    entry = Path(hf_home) / "hub" / ("models--" + name.replace("/", "--"))
    snapshot = entry / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(SNAPSHOT)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copyfile(tokenizer_dir / file, snapshot / file)
    return name


def trace_records(trace: Path, requests: int, max_blocks: int, block_tokens: int, trace_block_tokens: int,
                  output_tokens: int) -> list[dict]:
    """The first `requests` records of a Mooncake trace, cut to `max_blocks` hash ids each and scaled from
    the trace's block size to ours, in arrival order. Records keep their hash ids' order, so two requests
    that shared a prefix of blocks in the trace share it here."""
    records = []
    with open(trace) as f:
        for line in f:
            if len(records) == requests:
                break
            row = json.loads(line)
            ids = list(row["hash_ids"])[:max_blocks]
            if not ids:
                continue
            # the last block of a trace record is partly filled; keep that share of it
            full = min(row["input_length"], len(row["hash_ids"]) * trace_block_tokens)
            kept = min(full, len(ids) * trace_block_tokens)
            length = max(1, round(kept * block_tokens / trace_block_tokens))
            records.append({"timestamp": int(row.get("timestamp", 0)), "input_length": length,
                            "output_length": min(output_tokens, int(row.get("output_length", output_tokens)) or 1),
                            "hash_ids": ids})
    if not records:
        raise UsageError(f"{trace} has no usable record")
    start = records[0]["timestamp"]
    for r in records:
        r["timestamp"] -= start
    return records


def shared_block_share(records: list[dict]) -> float:
    """Share of the records' blocks whose hash id, with every id before it, appeared in an earlier record:
    the prefix reuse a perfect cache could get from this input (block granularity)."""
    seen: set[tuple] = set()
    shared = total = 0
    for r in records:
        ids = tuple(r["hash_ids"])
        for i in range(1, len(ids) + 1):
            total += 1
            shared += ids[:i] in seen
        seen.update(ids[:i] for i in range(1, len(ids) + 1))
    return shared / total if total else 0.0


def scrape_counters(url: str) -> dict[str, float]:
    try:
        return parse_counters(httpx.get(f"{url}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}


def served_model(url: str) -> str:
    try:
        return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise UsageError(f"cannot read the served model from {url}/v1/models: {exc}") from exc


def aiperf_command(aiperf: Path, url: str, model: str, tokenizer: str, out: Path, concurrency: int,
                   requests: int, input_file: Path | None, block_tokens: int, isl: int, osl: int) -> list[str]:
    cmd = [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", tokenizer, "--concurrency", str(concurrency), "--request-count", str(requests),
           "--artifact-dir", str(out), "--ui-type", "simple", "--random-seed", "0",
           "--extra-inputs", "ignore_eos:true"]
    if input_file is not None:
        cmd += ["--input-file", str(input_file), "--custom-dataset-type", "mooncake_trace",
                "--isl-block-size", str(block_tokens), "--no-fixed-schedule"]
    else:
        cmd += ["--isl", str(isl), "--osl", str(osl)]
    return cmd


def read_export(out: Path) -> dict:
    """aiperf's summary (profile_export_aiperf.json) as the figures the report shows."""
    path = out / "profile_export_aiperf.json"
    if not path.is_file():
        raise UsageError(f"aiperf wrote no {path.name} in {out} (see {out}/logs)")
    data = json.loads(path.read_text())

    def stat(name, key):
        value = (data.get(name) or {}).get(key)
        return None if value is None else float(value)

    errors = data.get("error_summary") or []
    return {
        "requests": stat("request_count", "avg"),
        "errors": sum(int(e.get("count", 0)) for e in errors) if isinstance(errors, list) else None,
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "ttft_avg_ms": stat("time_to_first_token", "avg"),
        "request_latency_p50_ms": stat("request_latency", "p50"),
        "prompt_tokens": stat("usage_prompt_tokens", "sum"),
        "cached_tokens_reported": stat("usage_prompt_cache_read_tokens", "sum"),
    }


def run_aiperf(args, name: str, input_file: Path | None) -> dict:
    out = Path(args.out_dir) / name
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "HF_HOME": str(Path(args.out_dir) / "hf-home"), "HF_HUB_OFFLINE": "1"}
    model = args.model or served_model(args.url)
    cmd = aiperf_command(Path(args.aiperf), args.url, model, args.hub_name, out, args.concurrency, args.requests,
                         input_file, args.block_tokens, args.isl, args.output_tokens)
    before = scrape_counters(args.url)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    after = scrape_counters(args.url)
    if done.returncode != 0:
        raise UsageError(f"aiperf exited {done.returncode}: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    row = {"run": name, **read_export(out)}
    prompt = after.get("prompt_tokens", 0) - before.get("prompt_tokens", 0)
    hits = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
    row.update(server_prompt_tokens=prompt, server_cached_tokens=hits,
               server_cached_share=hits / prompt if prompt else None,
               server_ttft_mean_ms=(1000 * (after.get("ttft_seconds_sum", 0) - before.get("ttft_seconds_sum", 0))
                                    / max(1.0, after.get("first_tokens", 0) - before.get("first_tokens", 0))))
    return row


def table(rows: list[dict]) -> str:
    def num(v, fmt="{:,.0f}"):
        return "-" if v is None else fmt.format(v)

    lines = ["| run | requests | errors | aiperf TTFT p50 / p99 | server's mean TTFT | prompt tokens | "
             "cached (server) | cached (aiperf's usage) | best possible (blocks) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['run']} | {num(r['requests'])} | {num(r['errors'])} | {num(r['ttft_p50_ms'])} / "
                     f"{num(r['ttft_p99_ms'])} ms | {num(r['server_ttft_mean_ms'])} ms | "
                     f"{num(r['server_prompt_tokens'])} | {num(r['server_cached_share'], '{:.1%}')} | "
                     f"{num(r['cached_tokens_reported'])} | {num(r.get('best_share'), '{:.1%}')} |")
    return "\n".join(lines)


def run_all(args) -> list[dict]:
    """The runs `args.runs` names, one row each."""
    if not Path(args.aiperf).is_file():
        raise UsageError(f"no aiperf at {args.aiperf}: `make aiperf` builds .venv-aiperf")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lay_hub_cache(Path(args.tokenizer_dir), out_dir / "hf-home", args.hub_name)
    rows = []
    if "synthetic" in args.runs:
        rows.append(run_aiperf(args, "synthetic", None))
    if "trace" in args.runs:
        records = trace_records(Path(args.trace), args.requests, args.max_blocks, args.block_tokens,
                                args.trace_block_tokens, args.output_tokens)
        input_file = out_dir / "trace.jsonl"
        input_file.write_text("".join(json.dumps(r) + "\n" for r in records))
        row = run_aiperf(args, "trace", input_file)
        row["best_share"] = shared_block_share(records)
        rows.append(row)
    return rows


def main_aiperf(args) -> int:
    rows = run_all(args)
    for row in rows:
        print(json.dumps(row), flush=True)
    print(table(rows))
    return 0


def register(sub) -> None:
    p = sub.add_parser("aiperf", help="run NVIDIA aiperf against a server (synthetic and a trace replay) "
                                      "and report its TTFT beside the server's hit counters")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--tokenizer-dir", required=True, help="a folder with the served model's tokenizer files")
    p.add_argument("--model", help="model id to send (default: the server's first /v1/models entry)")
    p.add_argument("--runs", default="synthetic,trace", help="comma list of synthetic, trace")
    p.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
                                          / "conversation_trace.jsonl"), help="a Mooncake-format JSONL trace")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-blocks", type=int, default=8, help="hash ids kept per trace record")
    p.add_argument("--block-tokens", type=int, default=128, help="prompt tokens per hash id sent (aiperf's "
                                                                 "--isl-block-size)")
    p.add_argument("--trace-block-tokens", type=int, default=512, help="tokens per hash id in the trace")
    p.add_argument("--isl", type=int, default=512, help="synthetic prompt tokens")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--aiperf", default=str(DEFAULT_AIPERF))
    p.add_argument("--hub-name", default=HUB_NAME)
    p.add_argument("--out-dir", default="out/aiperf")
    p.add_argument("--timeout", type=float, default=3600)
    p.set_defaults(func=main_aiperf)
