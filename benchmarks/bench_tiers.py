"""KV tiers on the bundled SmolLM2: time to first token for a long prompt served from each tier, and the hit
rate of a workload whose working set is five times the device pool, with and without each tier.

Part 1 (ttft): a chat of --length tokens (news text, then a question) is sent once cold (recomputed), then
with a new last question while its blocks sit in each place in turn:
- device: right after, in the device pool;
- host: after unrelated prompts pushed it out of a small device pool into host RAM (--cpu-cache-size);
- disk: on a server restarted on the same --disk-cache-dir (no host tier; the files are in the OS page cache,
  and also read after dropping the page cache when the benchmark may: root on Linux);
- redis: on a new server sharing the Redis the first one wrote to.
Each row gives TTFT, the tokens the tier served, the bytes per token moved, and the tier's read bandwidth as
the server measured it (bytes over seconds in /metrics).

Every server gets the same warm-up before its first measured request: one unrelated 64-token chat (its first
forward pays the one-time costs of a fresh process). The device and host rows then run on a server that has
computed long prompts (the cold run and two fillers); the disk and Redis rows are the first long request of
theirs. A measured request starts once the server's tier writers are idle (what it wrote through of the
prompts before is on disk and in Redis): the rows time the hit, not the writes of earlier requests. Each
measured request ends in a question of the same length (8 tokens), so the rows compute the same tokens after
the cached ones, except for what a tier cannot serve: disk and Redis keep whole blocks only, so the prompt's
last tokens inside a block are computed (the pool and host RAM copy a partly shared block). For the page-cache
disk row every file of the folder is read just before the request: that is what the row measures, and a
kernel may drop file pages it has not seen used for a while (this VM's pages out those unused for about a
minute).

Part 2 (working set): `reuse-loadgen run --workload multi-turn` (users who leave and come back), first
against a pool that holds everything (what it caches is the working set), then against a device pool of a
fifth of that (never less than two of the longest prompts): alone, then with a host tier, a disk tier and a
Redis tier each big enough for everything; prefix hit rate and TTFT from loadgen's report.

    .venv/bin/python -m benchmarks.bench_tiers [--length 4096] [--runs 1] [--skip-ttft] [--skip-working-set]
        [--working-set-requests 192]

One JSON line per measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from benchmarks.bench_ttft import TextSource, conversation, emit, server_process, served_model, stream_ttft, with_last_line
from reuse_server.server.launcher import redis_process

QUESTION = "In one sentence, what is the main event described above?"
ASKED = "Which place is named in part {}?"  # every measured row's last line: 8 tokens with each letter


def warm_page_cache(folder: str) -> int:
    """Read every file under folder (into the OS page cache); returns the bytes read."""
    total = 0
    for path in Path(folder).rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    total += len(chunk)
    return total


def tier_read(url: str) -> dict:
    """{tier: (read bytes, read seconds)} from the server's /metrics."""
    out: dict[str, list[float]] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for name, i in (("kvreuse_tier_read_bytes_total", 0), ("kvreuse_tier_read_seconds_total", 1)):
            if line.startswith(name + "{"):
                tier = line.split('tier="')[1].split('"')[0]
                out.setdefault(tier, [0.0, 0.0])[i] = float(line.split()[-1])
    return out


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def warm_up(client, model, tokenizer, source, rows: str, run: int) -> None:
    """Every server's first request, the same for each: an unrelated 64-token chat (its TTFT is what a fresh
    server's first request pays)."""
    seconds, _ = stream_ttft(client, model, conversation(tokenizer, source, 64, "Hello?"), 2)
    emit(bench="tiers_warmup", rows=rows, ttft_s=round(seconds, 4), run=run)


def writes_settled(url: str, timeout: float = 300.0) -> bool:
    """Wait until the server's tier writers are idle (every tier's write queue empty, the batch being written
    included), so that a measured request does not share the CPU with the writes of the prompts before it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tiers = httpx.get(url + "/v1/cache/stats").json()["tiers"]
        if all(not t.get("write_queue_bytes") for t in tiers.values()):
            return True
        time.sleep(0.2)
    return False


def timed(url, client, model, messages, tier: str, case: str, per_token_bytes: float, **extra) -> dict:
    writes_settled(url)
    before = tier_read(url)
    seconds, usage = stream_ttft(client, model, messages, 2)
    after = tier_read(url)
    details = usage.prompt_tokens_details
    served = getattr(details, "tier_tokens", None) or {}  # an extension field: the openai client keeps it a dict
    read = [after.get(tier, [0, 0])[i] - before.get(tier, [0, 0])[i] for i in (0, 1)]
    row = dict(bench="tiers_ttft", case=case, ttft_s=round(seconds, 4), prompt_tokens=usage.prompt_tokens,
               cached_tokens=details.cached_tokens, computed_tokens=usage.prompt_tokens - details.cached_tokens,
               tier_tokens=served.get(tier, 0) if tier != "device" else 0,
               bytes_per_token=per_token_bytes, read_mb=round(read[0] / 1e6, 2),
               bandwidth_gb_s=round(read[0] / read[1] / 1e9, 3) if read[1] else None, **extra)
    emit(**row)
    return row


def ttft_part(args, tokenizer) -> list[dict]:
    source = TextSource(tokenizer)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tiers-") as folder, redis_process(maxmemory="4gb") as (redis, _):
        disk = str(Path(folder) / "kv")
        # a device pool for ~1.3 prompts: the fillers push the first prompt out into host RAM
        pool = str(int(args.length * 1.3 * args.bytes_per_token))
        common = ("--model", args.model, "--max-num-batched-tokens", "8192", "--no-blend-key-shift")
        for run in range(args.runs):
            messages = conversation(tokenizer, source, args.length, QUESTION)
            with server_process(*common, "--kv-cache-memory", pool, "--cpu-cache-size", "8GB",
                                "--disk-cache-dir", disk, "--redis-url", redis) as (url, _):
                client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
                model = served_model(url)
                warm_up(client, model, tokenizer, source, "device, host", run)
                rows.append(timed(url, client, model, messages, "device", "recompute", args.bytes_per_token, run=run))
                rows.append(timed(url, client, model, with_last_line(messages, ASKED.format("A")),
                                  "device", "device", args.bytes_per_token, run=run))
                for i in range(2):
                    stream_ttft(client, model, conversation(tokenizer, source, args.length, QUESTION), 1)
                rows.append(timed(url, client, model, with_last_line(messages, ASKED.format("B")),
                                  "host", "host", args.bytes_per_token, run=run))
            for case, letter, flags in (("disk (page cache)", "C", ("--disk-cache-dir", disk)),
                                        ("disk (cold)", "D", ("--disk-cache-dir", disk)),
                                        ("redis", "E", ("--redis-url", redis))):
                if case == "disk (cold)" and not drop_page_cache():
                    continue
                with server_process(*common, "--kv-cache-memory", "2GiB", *flags) as (url, _):
                    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
                    model = served_model(url)
                    warm_up(client, model, tokenizer, source, case, run)
                    if case == "disk (page cache)":
                        warm_page_cache(disk)
                    rows.append(timed(url, client, model, with_last_line(messages, ASKED.format(letter)),
                                      case.split()[0], case, args.bytes_per_token, run=run))
    for case in dict.fromkeys(r["case"] for r in rows):
        picked = [r["ttft_s"] for r in rows if r["case"] == case]
        emit(bench="tiers_ttft_summary", case=case, ttft_s_median=statistics.median(picked), runs=len(picked))
    return rows


MAX_PROMPT_TOKENS = 1024
OUTPUT_TOKENS = 16


def run_loadgen(url: str, out: Path, requests: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "loadgen.cli", "run", "--server", url, "--workload", "multi-turn",
                           "--out", str(out), "--requests", str(requests), "--turns", "6", "--concurrency", "2",
                           "--return-fraction", "0.5", "--output-tokens", str(OUTPUT_TOKENS),
                           "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--no-plots", "--no-progress"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"reuse-loadgen run failed:\n{done.stderr[-2000:]}")
    return json.loads((out / "report.json").read_text())["workloads"]["multi-turn"]


def working_set_part(args) -> None:
    """Loadgen multi-turn with returning users: first against a pool that holds everything (the working set
    is what it caches), then against a pool of a fifth of that (at least one longest prompt), with each
    tier."""
    common = ("--model", args.model, "--max-num-batched-tokens", "4096", "--no-blend-key-shift")
    with tempfile.TemporaryDirectory(prefix="bench-tiers-ws-") as folder, redis_process(maxmemory="4gb") as (redis, _):
        setups = [("device holds all", ("--kv-cache-memory", "2GiB"))]
        working_set = None
        for name, flags in setups + [("device only", ()), ("+ host", ("--cpu-cache-size", "8GB")),
                                     ("+ disk", ("--disk-cache-dir", str(Path(folder) / "kv"))),
                                     ("+ redis", ("--redis-url", redis))]:
            if working_set is not None and name != "device holds all":
                pool_tokens = max(working_set // 5, 2 * (MAX_PROMPT_TOKENS + OUTPUT_TOKENS))
                flags = ("--kv-cache-memory", str(int(pool_tokens * args.bytes_per_token)), *flags)
            with server_process(*common, *flags) as (url, _):
                entry = run_loadgen(url, Path(folder) / name.replace(" ", "_").replace("+", "plus"),
                                    args.working_set_requests)
                stats = httpx.get(url + "/v1/cache/stats").json()
            if working_set is None:
                working_set = stats["device"]["cached_tokens"]
            emit(bench="tiers_working_set", setup=name, working_set_tokens=working_set,
                 device_pool_tokens=stats["device"]["total_blocks"] * stats["device"]["block_size"],
                 prompt_tokens=entry["prompt_tokens"], prefix_hit_rate=round(entry["prefix_hit_rate"], 4),
                 ttft_p50_ms=round(entry["ttft_ms"]["p50"], 1), tier_hits={t: s["hits"] for t, s in stats["tiers"].items()},
                 errors=entry["errors"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-working-set", action="store_true")
    ap.add_argument("--working-set-requests", type=int, default=192,
                    help="loadgen requests per setup (more requests: a larger working set)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from reuse_server.model.loader import resolve_model

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = json.loads((Path(path) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    args.bytes_per_token = 2 * config["num_hidden_layers"] * heads * head_dim * 4  # fp32 KV
    if not args.skip_ttft:
        ttft_part(args, tokenizer)
    if not args.skip_working_set:
        working_set_part(args)


if __name__ == "__main__":
    main()
