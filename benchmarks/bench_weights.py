"""Weight dtypes side by side in one run: memory, decode, prefill, TTFT and quality against fp32, with
llama.cpp's server on the same GGUF beside them when `llama-server` is on PATH.

Per weight dtype (fp32, bf16, int8, int4; `auto` is reported as the dtype it picks; "int4+a8" is int4 with
--activation-dtype int8), one server after another,
everything over HTTP with the openai client:
- rss_mib: the server's resident set after start-up and the requests above; ours holds a KV pool of
  --kv-cache-memory (written once at start, so resident), llama-server an f16 KV cache of its --ctx-size;
- decode_ms_b1 / decode_ms_b8: time between a stream's first and last token over its tokens - 1, for one
  stream and for 8 concurrent streams (the mean of the 8), `--decode-tokens` tokens each with ignore_eos;
- prefill_tok_s_<n>: prompt tokens / time to first token of a prompt of n new tokens (nothing cached);
- ttft_cold_s / ttft_warm_s at --ttft-tokens: a new conversation, then the same conversation with a new last
  line (median of 3), as bench_ttft measures them.
Quality against fp32, in this process through the engine (not for llama-server): the first-token KL median
and answer accuracy over bench_blend's needle cases (full prefill), and greedy agreement: the share of
generated tokens equal to fp32's at the same position over --greedy-prompts prompts x --greedy-tokens.

    .venv/bin/python -m benchmarks.bench_weights [--dtypes fp32,bf16,int8,int4,int4+a8] [--cases 30] [--no-llama]

The CPU of this project's machine is shared: compare figures within one run (ratios), not across runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import psutil
import torch

from benchmarks.bench_blend import CapturingSampler, kl, make_cases, prompt_for
from benchmarks.bench_ttft import TextSource, chat_tokens, conversation, server_process, served_model, with_last_line
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.builder import build_engine
from benchmarks.llama_server import running_llama_server
from reuse_server.model.loader import bundled_gguf_path, model_source, resolve_model
from reuse_server.model.quant_linear import NativeQuantLinear
from reuse_server.model.weight_dtype import choose
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

MIB = 1 << 20
DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


# ---- over HTTP: the same client code for our server and llama-server --------------------------------------

def stream(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streaming chat request: time to first content, time of the last, tokens generated."""
    start = time.perf_counter()
    first = last = None
    usage, pieces = None, 0
    for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "cache_prompt": True}):
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            last = time.perf_counter() - start
            first = last if first is None else first
            pieces += bool(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    # a server that leaves usage out of the stream: its content chunks (one a token) and our count of the prompt
    return dict(first=first, last=last, tokens=usage.completion_tokens if usage else pieces,
                prompt_tokens=usage.prompt_tokens if usage else None)


def ms_per_token(run: dict) -> float:
    return 1000 * (run["last"] - run["first"]) / max(1, run["tokens"] - 1)


def decode(client, model, streams: int, tokens: int) -> float:
    """Mean per-stream ms/token with `streams` concurrent streams (distinct prompts)."""
    results: list[dict] = [None] * streams

    def one(i):
        results[i] = stream(client, model, [{"role": "user", "content": f"{DECODE_PROMPT} (Version {i + 1}.)"}], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.mean(ms_per_token(r) for r in results)


async def _stream_lean(http: httpx.AsyncClient, url: str, model: str, content: str, max_tokens: int) -> dict:
    """stream()'s request and timings, read as raw SSE lines with json.loads: the openai SDK's per-chunk
    objects and one thread a stream cost ~0.4 ms of CPU a chunk, on the cores the server runs on."""
    body = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, ignore_eos=True, cache_prompt=True)
    start = time.perf_counter()
    first = last = usage = None
    pieces = 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and ((choices[0].get("delta") or {}).get("content") or choices[0].get("finish_reason")):
                last = time.perf_counter() - start
                first = last if first is None else first
                pieces += bool((choices[0].get("delta") or {}).get("content"))
            usage = chunk.get("usage") or usage
    return dict(first=first, last=last, tokens=usage["completion_tokens"] if usage else pieces,
                prompt_tokens=usage["prompt_tokens"] if usage else None)


def decode_lean(url: str, model: str, streams: int, tokens: int, cpu: list[float] | None = None) -> float:
    """decode()'s figure through one event loop reading raw SSE (_stream_lean) instead of the openai SDK.
    cpu: if given, gets this process's CPU seconds while the streams ran (not the client's set-up) appended."""
    import asyncio

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=1200) as http:
            start = time.process_time()
            results = await asyncio.gather(*(_stream_lean(http, url, model, f"{DECODE_PROMPT} (Version {i + 1}.)",
                                                          tokens) for i in range(streams)))
            if cpu is not None:
                cpu.append(time.process_time() - start)
            return results
    return statistics.mean(ms_per_token(r) for r in asyncio.run(run()))


def http_figures(url: str, pid: int, tokenizer, source: TextSource, args, decode_b8: bool = True) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
    model = served_model(url)
    stream(client, model, [{"role": "user", "content": "Hello?"}], 4)  # lazy initialisation out of the way
    row = {}
    row["decode_ms_b1"] = round(statistics.median(decode(client, model, 1, args.decode_tokens) for _ in range(2)), 2)
    if decode_b8:
        row["decode_ms_b8"] = round(decode(client, model, 8, args.decode_tokens), 2)
    for n in args.prefill_tokens:
        messages = conversation(tokenizer, source, n, "Summarize the text above.")
        run = stream(client, model, messages, 1)
        row[f"prefill_tok_s_{n}"] = round((run["prompt_tokens"] or chat_tokens(tokenizer, messages)) / run["first"], 1)
    messages = conversation(tokenizer, source, args.ttft_tokens, "In one sentence, what is the main event described above?")
    cold = stream(client, model, messages, 2)
    warm = [stream(client, model, with_last_line(messages, f"Question {i + 1}: name one place mentioned above."), 2)
            for i in range(3)]
    row.update(ttft_prompt_tokens=cold["prompt_tokens"], ttft_cold_s=round(cold["first"], 3),
               ttft_warm_s=round(statistics.median(w["first"] for w in warm), 4))
    row["rss_mib"] = round(psutil.Process(pid).memory_info().rss / MIB, 1)
    return row


# ---- llama.cpp's server -------------------------------------------------------------------------------------

@contextmanager
def llama_server(binary: str, gguf: Path, threads: int, slots: int, ctx: int) -> Iterator[tuple[str, subprocess.Popen]]:
    with running_llama_server(binary, gguf, ["-t", str(threads), "-tb", str(threads), "-c", str(ctx),
                                             "-np", str(slots), "--jinja"]) as running:
        yield running


# ---- quality, through the engine ----------------------------------------------------------------------------

def split_dtype(name: str) -> tuple[str, str]:
    """(weight dtype, activation dtype) of a --dtypes entry: "int4+a8" is int4 weights on int8 activations."""
    weights, _, a8 = name.partition("+")
    return weights, "int8" if a8 == "a8" else "fp32"


def quality_run(dtype: str, cases, tokenizer, args) -> dict:
    """First-token logits and answers of the needle cases, greedy continuations, and the weights' bytes."""
    weight_dtype, activation_dtype = split_dtype(dtype)
    engine = build_engine(EngineConfig(weight_dtype=weight_dtype, activation_dtype=activation_dtype,
                                       kv_cache_memory=512 * MIB, blend_key_shift=False, max_num_batched_tokens=8192))
    engine.sampler = sampler = CapturingSampler()
    greedy = SamplingParams(max_tokens=args.needle_tokens, temperature=0.0)
    answers = []
    for i, case in enumerate(cases):
        ids, _ = prompt_for(tokenizer, case.passages)
        engine.add_request(f"n{i}", ids, greedy, CacheOptions(prefix_cache=False))
        out = []
        while engine.has_work():
            for o in engine.step():
                out += o.new_token_ids
        answers.append(case.code in tokenizer.decode(out))
    long = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
    continuations = []
    for i, case in enumerate(cases[:args.greedy_prompts]):
        ids, _ = prompt_for(tokenizer, case.passages[:1])
        engine.add_request(f"g{i}", ids, long, CacheOptions(prefix_cache=False))
        out = []
        while engine.has_work():
            for o in engine.step():
                out += o.new_token_ids
        continuations.append(out)
    packed = [m for m in engine.model.modules() if isinstance(m, NativeQuantLinear)]
    head = engine.model.packed_head
    weights = sum(m.nbytes for m in packed) + (head.nbytes if isinstance(head, NativeQuantLinear) and head not in packed else 0)
    first = [sampler.first_logits[f"n{i}"] for i in range(len(cases))]
    result = dict(first=first, answers=answers, continuations=continuations, weight_dtype=engine.weight_dtype,
                  quantized_weights_mib=round(weights / MIB, 1) if packed else None)
    del engine
    gc.collect()
    return result


def quality_against(reference: dict, run: dict) -> dict:
    kls = [kl(p, q) for p, q in zip(reference["first"], run["first"])]
    pairs = [(a, b) for ra, rb in zip(reference["continuations"], run["continuations"]) for a, b in zip(ra, rb)]
    return dict(first_token_kl_median=statistics.median(kls), first_token_kl_max=max(kls),
                greedy_agreement=round(sum(a == b for a, b in pairs) / len(pairs), 4), greedy_tokens=len(pairs),
                needle_accuracy=round(sum(run["answers"]) / len(run["answers"]), 3))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp32,bf16,int8,int4,int4+a8")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", default="512,2048")
    ap.add_argument("--ttft-tokens", type=int, default=4096)
    ap.add_argument("--cases", type=int, default=30, help="needle cases for the first-token KL and accuracy")
    ap.add_argument("--needle-tokens", type=int, default=16, help="the answer repeats the question's words first")
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=40)
    ap.add_argument("--kv-cache-memory", default="384MiB")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server even when it is on PATH")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-servers", action="store_true", help="quality only")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="CPU threads of every server (OMP_NUM_THREADS for ours, -t/-tb for llama-server); on a "
                         "shared CPU one thread each is the steadier comparison")
    args = ap.parse_args(argv)
    args.prefill_tokens = [int(x) for x in args.prefill_tokens.split(",")]
    dtypes = args.dtypes.split(",")
    threads = args.threads
    os.environ["OMP_NUM_THREADS"] = str(threads)  # our servers' torch and kernel threads

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    source = TextSource(tokenizer)  # every prompt of the run is new text
    auto, why = choose("auto", model_source("smollm2"))
    emit(bench="weights_auto", picks=auto, why=why)

    if not args.skip_quality:
        cases = make_cases(args.cases, 4, seed=0, max_words=200)
        reference = quality_run("fp32", cases, tokenizer, args)
        for dtype in dtypes:
            run = reference if dtype == "fp32" else quality_run(dtype, cases, tokenizer, args)
            emit(bench="weights_quality", weight_dtype=dtype, cases=len(cases),
                 quantized_weights_mib=run["quantized_weights_mib"], **quality_against(reference, run))

    for dtype in [] if args.skip_servers else dtypes:
        weight_dtype, activation_dtype = split_dtype(dtype)
        with server_process("--model", "smollm2", "--weight-dtype", weight_dtype, "--activation-dtype",
                            activation_dtype, "--kv-cache-memory", args.kv_cache_memory,
                            "--max-num-batched-tokens", "8192", "--no-blend-key-shift") as (url, proc):
            emit(bench="weights_server", server="ours", weight_dtype=dtype, threads=threads,
                 kv_cache_memory=args.kv_cache_memory, **http_figures(url, proc.pid, tokenizer, source, args))

    binary = shutil.which("llama-server")
    if args.skip_servers:
        return
    if binary and not args.no_llama:
        gguf = bundled_gguf_path()
        ctx = args.ttft_tokens + 512
        with llama_server(binary, gguf, threads, 1, ctx) as (url, proc):
            row = http_figures(url, proc.pid, tokenizer, source, args, decode_b8=False)
        with llama_server(binary, gguf, threads, 8, 8 * 1024) as (url, proc):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
            row["decode_ms_b8"] = round(decode(client, served_model(url), 8, args.decode_tokens), 2)
        emit(bench="weights_server", server="llama-server", weight_dtype=gguf.name.split(".")[-2], threads=threads,
             ctx_size=ctx, **row)
    elif not args.no_llama:
        emit(bench="weights_server", server="llama-server", skipped="llama-server is not on PATH")


if __name__ == "__main__":
    main()
