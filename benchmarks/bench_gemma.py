"""Gemma 3 270M beside SmolLM2, over HTTP: Gemma with the layered KV pool (its sliding-window layers' KV in a
pool of their own, the default) and with `--window-kv-share 0` (one pool holding every layer of every block),
and SmolLM2-135M (the default model), one server at a time, all with `--weight-dtype auto` and
`--kv-cache-memory 2GiB` (fp32 KV).

Per server, in this order:
- ttft: first token cold and warm at each prompt length, as bench_ttft measures them (a new chat, then the
  same chat with a new last line, median of --warm-repeats); Gemma at --lengths, SmolLM2 at
  --smollm2-lengths (its context is 8,192 tokens, so its longest prompt is 8,000);
- kv_held: /v1/cache/stats "device" figures (the engine's memory) before and right after the cold request at
  the longest length (before its warm repeats): held_bytes (the KV bytes the used blocks take: on the layered
  pool every used block's full-attention layers plus the window parts pinned or cached), what the request
  added and the bytes per prompt token that implies, with the window figures;
- kv_running: the same figures while one more turn of that conversation decodes --running-tokens tokens
  (polled every --poll-s; the moment with the most window parts pinned);
- decode: ms per token of one stream (--decode-tokens streamed tokens with ignore_eos, the time between the
  first and the last token over tokens - 1, the median of 2 runs), as bench_weights measures it;
- loadgen: the multi-turn workload's prefix hit rate (`python -m loadgen.cli run --workload multi-turn`,
  BENCHMARKS.md's sizes), with /v1/cache/stats before and after (window parts evicted meanwhile).
A last Gemma server with a small window pool (--num-window-blocks, default 80, with --max-num-batched-tokens
512 so that a slice and a window fit in it) runs only the loadgen workload, to show what evicting windows costs
in hits.

    python -m benchmarks.bench_gemma [--lengths 2048,8192] [--skip smollm2] [--out benchmarks/results/bench_gemma.jsonl]

Prints one JSON line per measurement and appends them, after a header line (date, commit, machine), to --out
(not when benchmarks.run_all runs it: run_all writes the printed lines to that file itself).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import openai

from benchmarks.bench_ttft import (DOCS, TextSource, conversation, measure, measure_warm, server_process, served_model,
                                   stream_ttft, with_last_line)
from benchmarks.bench_weights import decode
from benchmarks.run_all import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bench_gemma.jsonl"
MIB = 1 << 20


class Recorder:
    """Prints each row as a JSON line and appends it to `path` (None: print only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def __call__(self, **row) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.path is not None:
            with open(self.path, "a") as out:
                out.write(line + "\n")


def run_by_run_all(path: Path) -> bool:
    """benchmarks.run_all has just opened `path` for this benchmark (its header is the file's only line) and
    writes what we print to it."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    if len(lines) != 1:
        return False
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        return False
    return isinstance(head, dict) and head.get("header") is True and head.get("benchmark") == "bench_gemma"


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes" if dirty else "")


def memory(url: str) -> dict:
    return httpx.get(url + "/v1/cache/stats", timeout=60).json()["device"]  # the engine's memory figures


WINDOW_KEYS = ("window_blocks", "window_blocks_pinned", "window_blocks_cached", "window_blocks_free",
               "window_parts_evicted")


def pool_figures(mem: dict) -> dict:
    return dict(pool_bytes=mem["pool_bytes"], total_blocks=mem["total_blocks"], block_size=mem["block_size"],
                bytes_per_block=mem["bytes_per_block"],
                pool_tokens=mem["total_blocks"] * mem["block_size"],
                **{k: mem[k] for k in WINDOW_KEYS if k in mem})


class Busiest:
    """Polls /v1/cache/stats in a thread while a request runs (the figures are the engine's snapshot after a
    step): the memory figures of the moment with the most window parts pinned (then the most bytes held)."""

    def __init__(self, url: str, every_s: float) -> None:
        self.url, self.every_s = url, every_s
        self.peak: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def key(mem: dict) -> tuple:
        return mem.get("window_blocks_pinned", 0), mem["held_bytes"]

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                mem = memory(self.url)
            except httpx.HTTPError:
                continue
            if self.peak is None or self.key(mem) > self.key(self.peak):
                self.peak = mem

    def __enter__(self) -> "Busiest":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def group_bytes(server: dict) -> tuple[int, int]:
    """(full-attention layers' bytes, a window part's bytes) per block, from the pool's figures at start:
    bytes_per_block = F + W and pool_bytes = total_blocks x F + (window_blocks + 1) x W (part 0 reserved)."""
    if "window_blocks" not in server:
        return server["bytes_per_block"], 0
    total, parts, per_block = server["total_blocks"], server["window_blocks"] + 1, server["bytes_per_block"]
    window = round((server["pool_bytes"] - total * per_block) / (parts - total))
    return per_block - window, window


def held_row(before: dict, after: dict, prompt_tokens: int, server: dict) -> dict:
    """What one request left in the pool: held_bytes after it (all of the pool's) and its difference from
    before it, per prompt token; on the layered pool split into the full-attention layers of every block it
    added and the window parts (pinned by a running sequence, or cached: evictable when parts run short)."""
    full, part = group_bytes(server)
    added = after["held_bytes"] - before["held_bytes"]
    used = lambda m: m["total_blocks"] - m["free_blocks"]  # noqa: E731
    row = dict(held_bytes=after["held_bytes"], held_mib=round(after["held_bytes"] / MIB, 1),
               added_bytes=added, added_mib=round(added / MIB, 1), added_bytes_per_token=round(added / prompt_tokens, 1),
               added_blocks=used(after) - used(before), bytes_per_block=after["bytes_per_block"])
    if part:
        cached = after["window_blocks_cached"] - before["window_blocks_cached"]
        pinned = after["window_blocks_pinned"] - before["window_blocks_pinned"]
        row.update(full_layer_bytes_per_block=full, window_part_bytes_per_block=part,
                   added_full_layer_mib=round(row["added_blocks"] * full / MIB, 1),
                   added_window_parts_cached=cached, added_window_parts_pinned=pinned,
                   added_window_cached_mib=round(cached * part / MIB, 1),
                   **{k: after[k] for k in WINDOW_KEYS})
    return row


def ttft_part(url: str, tokenizer, source: TextSource, lengths: list[int], args, record, label: dict,
              server: dict) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
    model = served_model(url)
    stream_ttft(client, model, conversation(tokenizer, source, 64, "Hello?"), 2)  # lazy initialisation first
    for i, length in enumerate(lengths):
        if i < len(lengths) - 1:
            record(**measure(url, client, model, tokenizer, source, length, args.warm_repeats, 2), **label)
            continue
        # the longest: what the pool holds right after the cold request, before the warm ones add to it
        messages = conversation(tokenizer, source, length, "In one sentence, what is the main event described above?")
        before = memory(url)
        cold_s, usage = stream_ttft(client, model, messages, 2)
        after = memory(url)
        record(bench="kv_held", prompt_tokens=usage.prompt_tokens, **held_row(before, after, usage.prompt_tokens, server),
               **label)
        # its warm repeats, timed as bench_ttft times them (the cold figure is the one above)
        record(**measure_warm(url, client, model, messages, usage, cold_s, args.warm_repeats, 2), **label)
        # one more turn of it, decoding --running-tokens: what the pool holds while the sequence runs
        with Busiest(url, args.poll_s) as busiest:
            stream_ttft(client, model, with_last_line(messages, "Question 9: who is named first above?"),
                        args.running_tokens)
        if busiest.peak is not None:
            peak = busiest.peak
            record(bench="kv_running", prompt_tokens=usage.prompt_tokens, decode_tokens=args.running_tokens,
                   held_mib=round(peak["held_bytes"] / MIB, 1), held_bytes=peak["held_bytes"],
                   running=peak.get("sequence_blocks"), **{k: peak[k] for k in WINDOW_KEYS if k in peak}, **label)


def decode_part(url: str, args, record, label: dict) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
    model = served_model(url)
    runs = [decode(client, model, 1, args.decode_tokens) for _ in range(2)]
    record(bench="decode", streams=1, decode_tokens=args.decode_tokens, decode_ms_b1=round(statistics.median(runs), 2),
           runs_ms=[round(r, 2) for r in runs], **label)


def loadgen_part(url: str, args, record, label: dict) -> None:
    before = memory(url)
    with tempfile.TemporaryDirectory(prefix="bench-gemma-loadgen-") as folder:
        out = Path(folder) / "report"
        cmd = [sys.executable, "-m", "loadgen.cli", "run", "--server", url, "--workload", "multi-turn",
               "--out", str(out), "--requests", str(args.requests), "--concurrency", str(args.concurrency),
               "--system-tokens", str(args.system_tokens), "--turns", str(args.turns),
               "--max-prompt-tokens", str(args.max_prompt_tokens), "--output-tokens", str(args.output_tokens),
               "--no-plots", "--no-progress"]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode not in (0, 1):  # 1: some requests failed; the report says which
            raise RuntimeError(f"loadgen failed ({done.returncode}):\n{done.stderr[-3000:]}")
        entry = json.loads((out / "report.json").read_text())["workloads"]["multi-turn"]
    after = memory(url)
    keep = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens", "prefix_hit_rate",
            "output_tokens_per_s", "duration_s")
    row = {k: entry[k] for k in keep if k in entry}
    row["prefix_hit_rate"] = round(row["prefix_hit_rate"], 4)
    if "ttft_ms" in entry:
        row["ttft_p50_ms"] = round(entry["ttft_ms"]["p50"], 1)
    window = {f"after_{k}": after[k] for k in WINDOW_KEYS if k in after}
    if "window_parts_evicted" in after:
        window["window_parts_evicted_during"] = after["window_parts_evicted"] - before["window_parts_evicted"]
    record(bench="loadgen", workload="multi-turn", requests_asked=args.requests, concurrency=args.concurrency,
           system_tokens=args.system_tokens, turns=args.turns, max_prompt_tokens=args.max_prompt_tokens,
           output_tokens=args.output_tokens, **row, after_held_bytes=after["held_bytes"], **window, **label)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192", help="Gemma's prompt lengths (the last: KV held)")
    ap.add_argument("--smollm2-lengths", default="2048,8000", help="SmolLM2's (its context is 8,192)")
    ap.add_argument("--warm-repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-num-batched-tokens", default="8192", help="as bench_ttft runs its servers")
    ap.add_argument("--small-window-blocks", type=int, default=80,
                    help="the last Gemma server's --num-window-blocks (0: skip that server)")
    ap.add_argument("--small-window-batched-tokens", default="512",
                    help="its --max-num-batched-tokens: a slice's window parts and one window must fit in its parts")
    ap.add_argument("--running-tokens", type=int, default=64,
                    help="tokens decoded by the turn after the longest prompt, while /v1/cache/stats is polled")
    ap.add_argument("--poll-s", type=float, default=0.05, help="/v1/cache/stats polling during that turn")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=800)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma-separated of: layered, share0, small-window, smollm2, ttft, "
                                                "decode, loadgen")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON lines appended here ('' : print only)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    from transformers import AutoTokenizer

    from reuse_server.model.loader import resolve_model

    path = args.out if str(args.out) not in ("", ".") else None
    if path is not None and run_by_run_all(path):
        path = None
    record = Recorder(path)
    started = datetime.datetime.now(datetime.timezone.utc)
    record(bench="gemma_header", date=started.isoformat(timespec="seconds"), commit=commit(),
           command=["python", "-m", "benchmarks.bench_gemma", *(sys.argv[1:] if argv is None else argv)],
           machine=machine(), source="lee_background.cor" if DOCS.exists() else "filler")

    common = ("--weight-dtype", "auto", "--kv-cache-memory", args.kv_cache_memory)
    gemma_lengths = [int(x) for x in args.lengths.split(",")]
    servers = [  # (name, model, extra flags, parts)
        ("layered", "gemma3-270m", (), ("ttft", "decode", "loadgen"), gemma_lengths),
        ("share0", "gemma3-270m", ("--window-kv-share", "0"), ("ttft", "decode", "loadgen"), gemma_lengths),
        ("small-window", "gemma3-270m", ("--num-window-blocks", str(args.small_window_blocks),
                                          "--max-num-batched-tokens", args.small_window_batched_tokens), ("loadgen",), []),
        ("smollm2", "smollm2", (), ("ttft", "decode", "loadgen"), [int(x) for x in args.smollm2_lengths.split(",")]),
    ]
    if not args.small_window_blocks:
        skip.add("small-window")
    sources: dict[str, TextSource] = {}
    tokenizers: dict[str, object] = {}
    for name, model, flags, parts, lengths in servers:
        parts = [p for p in parts if p not in skip]
        if name in skip or not parts:
            continue
        if model not in tokenizers:
            tokenizers[model] = AutoTokenizer.from_pretrained(resolve_model(model))
            sources[model] = TextSource(tokenizers[model])  # every prompt of the run is new text
        label = dict(model=model, pool=name, server_flags=list(flags))
        serve = ("--model", model, *common, "--max-num-batched-tokens", args.max_num_batched_tokens, *flags)
        with server_process(*serve) as (url, _):
            server = memory(url)
            record(bench="server", **pool_figures(server), **label)
            if "ttft" in parts:
                ttft_part(url, tokenizers[model], sources[model], lengths, args, record, label, server)
            if "decode" in parts:
                decode_part(url, args, record, label)
            if "loadgen" in parts:
                loadgen_part(url, args, record, label)
    record(bench="gemma_done", seconds=round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()))


if __name__ == "__main__":
    main()
