"""Engine throughput on the bundled SmolLM2 against transformers running the same weights, in one run.

Prefill tokens/s (one prompt), decode tokens/s at batch 1 and 8 (equal prompts: transformers' best case),
and serving throughput on mixed-size requests (our continuous batching against transformers' static
batches of 8, padded, each running to its longest output). Prints JSON lines.
    .venv/bin/python -m benchmarks.bench_engine [--prefill-lens 512,2048] [--decode-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.model.loader import resolve_model
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def prompt_of(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def ours_prefill(engine: LLMEngine, n: int, salt: int) -> float:
    engine.add_request(f"p{salt}", prompt_of(n, salt), SamplingParams(max_tokens=1, temperature=0.0),
                       CacheOptions(prefix_cache=False))
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t


@torch.inference_mode()
def hf_prefill(model, n: int, salt: int) -> float:
    ids = torch.tensor([prompt_of(n, salt)])
    t = time.perf_counter()
    model(ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t


def ours_decode(engine: LLMEngine, batch: int, context: int, new: int) -> float:
    params = SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{batch}-{b}", prompt_of(context, 1000 + b), params, CacheOptions(prefix_cache=False))
    # prefill everything (each request samples its first token), then time the decode steps alone
    while any(s.num_computed < len(s.prompt_ids) for s in engine.seqs.values()):
        engine.step()
    t = time.perf_counter()
    produced = 0
    while engine.has_work():
        produced += len(engine.step())
    return produced / (time.perf_counter() - t)


@torch.inference_mode()
def hf_decode(model, batch: int, context: int, new: int) -> float:
    ids = torch.tensor([prompt_of(context, 1000 + b) for b in range(batch)])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    t = time.perf_counter()
    for _ in range(new):
        out = model(token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
    return batch * new / (time.perf_counter() - t)


def serving_mix(n: int, seed: int) -> list[tuple[list[int], int]]:
    """n requests of mixed sizes, like a chat server sees: (prompt ids, output tokens)."""
    rng = random.Random(seed)
    return [(prompt_of(rng.randint(64, 512), 5000 + i), rng.randint(8, 128)) for i in range(n)]


def ours_serving(engine: LLMEngine, mix) -> float:
    """All requests arrive at once; continuous batching admits and retires them step by step."""
    t = time.perf_counter()
    for i, (ids, out) in enumerate(mix):
        engine.add_request(f"s{i}", ids, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
                           CacheOptions(prefix_cache=False))
    while engine.has_work():
        engine.step()
    return sum(out for _, out in mix) / (time.perf_counter() - t)


@torch.inference_mode()
def hf_serving(model, mix, batch: int) -> float:
    """transformers' static batching: batches of `batch` in arrival order, left-padded, each generating
    until its longest request is done (the useful tokens are what each request asked for)."""
    t = time.perf_counter()
    for b in range(0, len(mix), batch):
        group = mix[b:b + batch]
        width = max(len(ids) for ids, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        longest = max(out for _, out in group)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0)
    return sum(out for _, out in mix) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-lens", default="512,2048")
    ap.add_argument("--decode-context", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--weight-dtype", default="auto", help="how our engine holds its weights (--weight-dtype)")
    ap.add_argument("--serving-requests", type=int, default=32,
                    help="mixed-size requests for the serving comparison (0 skips it)")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_model(None)
    engine = build_engine(EngineConfig(max_num_batched_tokens=8192, max_num_seqs=16, kv_cache_memory=1 << 30,
                                       weight_dtype=args.weight_dtype))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    ours_prefill(engine, 64, 1), hf_prefill(hf, 64, 1)  # warm-up: first calls pay one-time kernel set-up
    for n in [int(x) for x in args.prefill_lens.split(",")]:
        ours = min(ours_prefill(engine, n, 10 * n + r) for r in range(args.repeats))
        ref = min(hf_prefill(hf, n, 10 * n + r) for r in range(args.repeats))
        emit(bench="prefill", tokens=n, ours_tok_s=round(n / ours, 1), transformers_tok_s=round(n / ref, 1),
             ratio=round(ref / ours, 2))
    for batch in (1, 8):
        ours = ours_decode(engine, batch, args.decode_context, args.decode_tokens)
        ref = hf_decode(hf, batch, args.decode_context, args.decode_tokens)
        emit(bench="decode", batch=batch, context=args.decode_context, ours_tok_s=round(ours, 1),
             transformers_tok_s=round(ref, 1), ratio=round(ours / ref, 2))
    if args.serving_requests:
        mix = serving_mix(args.serving_requests, seed=0)
        engine.scheduler.max_num_seqs = 8  # the same concurrency as transformers' batches
        ours = ours_serving(engine, mix)
        ref = hf_serving(hf, mix, batch=8)
        emit(bench="serving", requests=len(mix), concurrency=8, prompt_tokens="64-512", output_tokens="8-128",
             ours_tok_s=round(ours, 1), transformers_static_batch8_tok_s=round(ref, 1), ratio=round(ours / ref, 2))


if __name__ == "__main__":
    main()
