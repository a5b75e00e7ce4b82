"""Time to first token over HTTP on the bundled SmolLM2, cold vs warm prefix cache.

For each prompt length, a chat of that many tokens (a system message holding news text from the shared
Lee corpus, or filler text when it is absent, then a user question) is sent twice over: cold, the first
time the server sees the text; warm, the same conversation with a new last user line, so everything but
the last message can come from the prefix cache. TTFT is the time from sending the streaming request to
the first chunk that carries generated content (the role-only chunk the server sends first is skipped).
warm_engine_s is the server's own TTFT for the warm requests (from its /metrics histogram: engine
admission to first token), so warm_s - warm_engine_s is what HTTP, prompt rendering and the client add.

    .venv/bin/python -m benchmarks.bench_ttft [--lengths 512,2048,4096] [--warm-repeats 3] [--servers 3]

Prints one JSON line per length and server, then one summary line per length (the median ratio over the
servers). Each server runs in a subprocess, one after another.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai

from reuse_server.server.launcher import served, with_small_pool

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO.parent / "shared" / "data" / "docs" / "lee_background.cor"
FILLER = ("The committee met on a Tuesday to review the harbour accounts, the state of the northern road, "
          "and the schedule of the autumn fair; each item was read aloud and noted in the minutes. ")


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


@contextmanager
def server_process(*serve_args: str, startup_timeout: float = 600) -> Iterator[tuple[str, subprocess.Popen]]:
    """`reuse-server serve *serve_args` on a free loopback port; yields (base URL, process) once /health
    answers, and stops the server on the way out. Its log goes to a temporary file, kept if it shows a
    traceback. A benchmark that names no pool size gets the small one its figures were measured with
    (with_small_pool); one measuring the default sizing passes --kv-cache-memory auto."""
    log = Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])
    with served(with_small_pool(serve_args), log, startup_timeout, cwd=REPO) as running:
        yield running
    if "Traceback" in log.read_text():
        print(f"server log {log} holds a traceback", file=sys.stderr)
    else:
        log.unlink()


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def corpus_text() -> str:
    if DOCS.exists():
        return DOCS.read_text()
    return FILLER * 2000


class TextSource:
    """Hands out consecutive, never repeated stretches of the corpus, measured in tokens, so that no two
    prompts of a run share a prefix beyond the chat template's framing."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
        self.offset = 0

    def take(self, num_tokens: int) -> str:
        if self.offset + num_tokens > len(self.ids):
            raise ValueError(f"the corpus has {len(self.ids)} tokens; {self.offset + num_tokens} needed")
        text = self.tokenizer.decode(self.ids[self.offset:self.offset + num_tokens])
        self.offset += num_tokens
        return text


def chat_tokens(tokenizer, messages: list[dict]) -> int:
    """Prompt tokens of `messages` as the server counts them (each chunk tokenized alone)."""
    # imported here: the blend package imports torch, and a driver that maps torch's libraries keeps them
    # resident in the server it measures (bench_memory: the server pages out what only it maps)
    from blend.chunking import render_chat_chunks

    return sum(len(c.tokens) for c in render_chat_chunks(tokenizer, messages))


def conversation(tokenizer, source: TextSource, total_tokens: int, question: str) -> list[dict]:
    """[system: document, user: question] rendering to about `total_tokens` tokens."""
    framing = chat_tokens(tokenizer, [{"role": "system", "content": "x"}, {"role": "user", "content": question}]) - 1
    document = source.take(max(1, total_tokens - framing))
    return [{"role": "system", "content": document}, {"role": "user", "content": question}]


def with_last_line(messages: list[dict], question: str) -> list[dict]:
    return messages[:-1] + [{"role": "user", "content": question}]


def server_ttft_sum(url: str) -> float:
    """The server's own TTFT histogram sum (engine admission to first token, no HTTP or prompt rendering)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvreuse_time_to_first_token_seconds_sum"):
            return float(line.split()[-1])
    return float("nan")


def stream_ttft(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[float, object]:
    """(seconds to the first generated content, usage) of one streaming chat request."""
    start = time.perf_counter()
    first, usage = None, None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    return first, usage


def measure(url, client, model, tokenizer, source: TextSource, length: int, warm_repeats: int,
            max_tokens: int) -> dict:
    messages = conversation(tokenizer, source, length, "In one sentence, what is the main event described above?")
    cold_s, cold_usage = stream_ttft(client, model, messages, max_tokens)
    return measure_warm(url, client, model, messages, cold_usage, cold_s, warm_repeats, max_tokens)


def measure_warm(url, client, model, messages, cold_usage, cold_s: float, warm_repeats: int, max_tokens: int) -> dict:
    """The row for a conversation whose cold request was sent (and timed): its warm repeats, each with a new
    last line."""
    warm, engine_warm = [], []
    for i in range(warm_repeats):
        question = f"Question {i + 1}: name one place mentioned in the text above."
        before = server_ttft_sum(url)
        warm.append(stream_ttft(client, model, with_last_line(messages, question), max_tokens))
        engine_warm.append(server_ttft_sum(url) - before)
    warm_s = statistics.median(s for s, _ in warm)
    usage = warm[-1][1]
    cached = usage.prompt_tokens_details.cached_tokens
    return dict(bench="ttft", prompt_tokens=cold_usage.prompt_tokens,
                cold_cached_tokens=cold_usage.prompt_tokens_details.cached_tokens,
                cold_s=round(cold_s, 4), warm_s=round(warm_s, 4), warm_min_s=round(min(s for s, _ in warm), 4),
                ratio=round(cold_s / warm_s, 1), warm_prompt_tokens=usage.prompt_tokens, warm_cached_tokens=cached,
                warm_uncached_tokens=usage.prompt_tokens - cached,
                warm_engine_s=round(statistics.median(engine_warm), 4), warm_repeats=warm_repeats,
                max_tokens=max_tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048,4096", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--warm-repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--dtype", default="auto", help="the server's --dtype (auto: fp32 on the CPU)")
    ap.add_argument("--weight-dtype", default="auto", help="the server's --weight-dtype")
    ap.add_argument("--servers", type=int, default=3,
                    help="repeat everything on this many fresh servers, one after another (the ratio varies more "
                         "between server processes than between requests); a summary row per length gives the median")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from reuse_server.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    source = TextSource(tokenizer)  # shared by the servers: every prompt of the run is new text
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: dict[int, list[dict]] = {length: [] for length in lengths}
    for server in range(args.servers):
        with server_process("--model", args.model, "--max-num-batched-tokens", "8192", "--weight-dtype", args.weight_dtype,
                            "--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            model = served_model(url)
            # one small request first, so the first timed request does not pay for lazy initialisation
            stream_ttft(client, model, conversation(tokenizer, source, 64, "Hello?"), args.max_tokens)
            for length in lengths:
                row = measure(url, client, model, tokenizer, source, length, args.warm_repeats, args.max_tokens)
                rows[length].append(row)
                emit(**row, server=server, source="lee_background.cor" if DOCS.exists() else "filler",
                     dtype=args.dtype)
    for length, runs in rows.items():
        emit(bench="ttft_summary", prompt_tokens=runs[0]["prompt_tokens"], servers=len(runs),
             ratio_median=statistics.median(r["ratio"] for r in runs), ratios=[r["ratio"] for r in runs],
             cold_s_median=statistics.median(r["cold_s"] for r in runs),
             warm_s_median=statistics.median(r["warm_s"] for r in runs), dtype=args.dtype)


if __name__ == "__main__":
    main()
