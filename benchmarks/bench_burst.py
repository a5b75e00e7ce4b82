"""A burst of requests sharing a system prompt nobody has sent before, over HTTP on the bundled SmolLM2:
with prefill dedup (the default) the first request computes the shared prompt and the others wait a step and
hit it; with `--no-prefill-dedup` (the baseline) every request admitted in the same step computes it.

For each server setting (fresh server each time): N streaming chat requests are sent at once, each a system
message of S tokens of new corpus text (the same for all N) plus its own question, into an idle server and
into a busy one (one long generation streaming meanwhile, so the burst piles up during a step). Reported per setting:
prompt tokens computed (prompt tokens minus prefix-cache hits, from /metrics), TTFT median and max over the N
requests (the max: when the last request got its first token), and the wall time to the last response.

    .venv/bin/python -m benchmarks.bench_burst [--requests 8] [--system-tokens 1024] [--budget 2048,8192]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from benchmarks.bench_ttft import DOCS, TextSource, conversation, served_model, server_process, stream_ttft


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return float("nan")


def keep_busy(client, model, tokenizer, source: TextSource, started: threading.Event) -> None:
    """One long generation, so that the burst arrives while the engine is stepping (the usual case under load:
    the requests pile up during a step and are admitted together at the next one)."""
    stream = client.chat.completions.create(model=model, messages=conversation(tokenizer, source, 64, "Go on."),
                                            max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    for _ in stream:
        started.set()


def burst(url: str, tokenizer, source: TextSource, requests: int, system_tokens: int, max_tokens: int,
          busy: bool) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = served_model(url)
    stream_ttft(client, model, conversation(tokenizer, source, 64, "Hello?"), max_tokens)  # lazy initialisation
    system = conversation(tokenizer, source, system_tokens, "x")[0]
    chats = [[system, {"role": "user", "content": f"Question {i + 1}: name one place the text mentions."}]
             for i in range(requests)]
    background = None
    if busy:
        started = threading.Event()
        background = threading.Thread(target=keep_busy, args=(client, model, tokenizer, source, started))
        background.start()
        started.wait()
    prompt_before = counter(url, "kvreuse_prompt_tokens_total")
    hits_before = counter(url, "kvreuse_prefix_cache_hits_total")
    start = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        ttfts = [ttft for ttft, _ in pool.map(lambda chat: stream_ttft(client, model, chat, max_tokens), chats)]
    prompt = counter(url, "kvreuse_prompt_tokens_total") - prompt_before
    hits = counter(url, "kvreuse_prefix_cache_hits_total") - hits_before
    if background is not None:
        background.join()
    return dict(prompt_tokens=int(prompt), prefix_hit_tokens=int(hits), computed_prompt_tokens=int(prompt - hits),
                ttft_median_s=round(statistics.median(ttfts), 3), ttft_max_s=round(max(ttfts), 3),
                wall_s=round(time.perf_counter() - start, 3))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--budget", default="2048,8192", help="comma-separated --max-num-batched-tokens to run")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from reuse_server.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    source = TextSource(tokenizer)  # every burst gets text no server has seen
    for budget, busy in [(int(b), busy) for b in args.budget.split(",") for busy in (False, True)]:
        rows = {}
        for setting, flags in (("dedup", []), ("no-dedup", ["--no-prefill-dedup"])):
            with server_process("--model", args.model, "--max-num-batched-tokens", str(budget),
                                "--max-num-seqs", str(max(16, args.requests + 1)), *flags) as (url, _):
                rows[setting] = burst(url, tokenizer, source, args.requests, args.system_tokens, args.max_tokens,
                                      busy)
            emit(bench="burst", setting=setting, budget=budget, busy=busy, requests=args.requests,
                 system_tokens=args.system_tokens, source="lee_background.cor" if DOCS.exists() else "filler",
                 **rows[setting])
        a, b = rows["dedup"], rows["no-dedup"]
        emit(bench="burst_summary", budget=budget, busy=busy, requests=args.requests,
             computed_tokens_ratio=round(b["computed_prompt_tokens"] / a["computed_prompt_tokens"], 2),
             ttft_median_ratio=round(b["ttft_median_s"] / a["ttft_median_s"], 2),
             ttft_max_ratio=round(b["ttft_max_s"] / a["ttft_max_s"], 2))


if __name__ == "__main__":
    main()
