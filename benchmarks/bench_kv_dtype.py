"""KV precision on the bundled SmolLM2: for each --kv-dtype, what a token costs, what it does to quality
against the fp32 pool, and what it does to speed, in one run.

Per KV dtype (the fp32 engine stays up; each other dtype's engine is built next to it, measured, dropped):
- size: bytes per token (kv_layout's formula, scales included) and tokens per GiB;
- quality against fp32 on real text (Lee corpus articles in the chat template): the first answer token's
  KL divergence (fp32 || dtype), median over prompts; greedy agreement over --greedy-tokens generated
  tokens (the share of tokens before the first divergence, and how many continuations are identical);
  the needle test's accuracy (benchmarks/bench_blend.py's cases) with full prefill and with blending;
- speed, measured alternately with the fp32 engine in the same phase (the CPU is shared: compare ratios):
  warm TTFT at --ttft-tokens (the same conversation with a new last line, the rest a prefix hit) and
  decode tokens/s at batch 1 and 8 (benchmarks/bench_engine.py's decode).
Blending on quantized keys: the error of a reused key moved by re-RoPE when the pool dequantizes, rotates and
requantizes it (what the pool does) against keeping keys unrotated (stored before RoPE, rotated as read),
both against the exact key. --tier-kv-dtype: the fp32 pool's cached prefix sent through a tier copy in a
smaller dtype and back, first-token KL against the untouched prefix. --ab-kernel-ref REV: the fp32 warm step
with the attention kernel of git revision REV against this one, alternately in the fp32 engine.

    .venv/bin/python -m benchmarks.bench_kv_dtype [--dtypes fp16,bf16,fp8_e4m3,int8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_blend import (DOCS, CapturingSampler, kl, load_articles, make_cases, precompute_passages,
                                    prompt_for, run_one, template_lead)
from benchmarks.bench_engine import ours_decode
from benchmarks.bench_ttft import TextSource, conversation, with_last_line
from blend.chunking import render_chat_chunks
from blend.key_shift import moved_keys, unrope
from blend.rope import apply_rope, rerope_dense
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.kv.pool import KVPool
from reuse_server.model import cpu_attention, native
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

REPO = Path(__file__).resolve().parents[1]
KL_QUESTION = "In one sentence, what is the text above about?"


def emit(**row) -> dict:
    print(json.dumps(row), flush=True)
    return row


def make_engine(kv_dtype: str, memory: int) -> LLMEngine:
    engine = build_engine(EngineConfig(kv_dtype=kv_dtype, kv_cache_memory=memory, max_num_batched_tokens=8192,
                                       max_num_seqs=16, enable_blend=False, blend_min_tokens=16))
    engine.sampler = CapturingSampler()
    return engine


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return [t for chunk in render_chat_chunks(tokenizer, messages) for t in chunk.tokens]


def text_prompts(tokenizer, n: int, words: int) -> list[list[int]]:
    articles = load_articles(min_words=words, max_words=words)[:n]
    return [chat_ids(tokenizer, [{"role": "user", "content": f"{a}\n\n{KL_QUESTION}"}]) for a in articles]


def first_logits(engine: LLMEngine, rid: str, ids: list[int], prefix_cache: bool = False) -> torch.Tensor:
    run_one(engine, rid, ids, [], blend=False, ratio=None, max_tokens=1, prefix_cache=prefix_cache)
    return engine.sampler.first_logits.pop(rid)


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int, tag: str) -> list[list[int]]:
    """Every prompt's greedy continuation, the prompts decoded together as one batch."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"g{tag}-{i}", ids, params, CacheOptions(prefix_cache=False))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.sampler.first_logits.clear()
    return [out[f"g{tag}-{i}"] for i in range(len(prompts))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    leading = []
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        leading.append(n / len(a))
    return dict(greedy_prefix_agreement=round(statistics.fmean(leading), 4),
                greedy_identical=sum(x == 1.0 for x in leading), greedy_prompts=len(leading))


def needle(engine: LLMEngine, cases, ratio: float, max_tokens: int, tag: str) -> dict:
    """bench_blend's needle cases: accuracy of full prefill and of blending (passages precomputed alone)."""
    tok = engine.tokenizer
    lead = template_lead(tok)
    full = blended = 0
    for i, case in enumerate(cases):
        precompute_passages(engine, case.passages, lead, f"{tag}{i}")
        order = case.passages[1:] + case.passages[:1]  # served in another order than precomputed
        ids, spans = prompt_for(tok, order)
        out, _, _ = run_one(engine, f"nf{tag}{i}", ids, spans, blend=False, ratio=None, max_tokens=max_tokens)
        full += case.code in tok.decode(out, skip_special_tokens=True)
        out, _, _ = run_one(engine, f"nb{tag}{i}", ids, spans, blend=True, ratio=ratio, max_tokens=max_tokens,
                            prefix_cache=True)
        blended += case.code in tok.decode(out, skip_special_tokens=True)
    engine.sampler.first_logits.clear()
    return dict(needle_cases=len(cases), needle_accuracy_full=round(full / len(cases), 4),
                needle_accuracy_blend=round(blended / len(cases), 4), needle_blend_ratio=ratio)


def engine_ttft(engine: LLMEngine, rid: str, ids: list[int]) -> float:
    _, first, _ = run_one(engine, rid, ids, [], blend=False, ratio=None, max_tokens=1, prefix_cache=True)
    engine.sampler.first_logits.pop(rid, None)
    return first


def alternate(engines: dict[str, LLMEngine], measure, repeats: int) -> dict[str, list[float]]:
    """measure(engine, name, repeat) for every engine in turn, `repeats` rounds (shared-CPU drift hits all)."""
    results = {name: [] for name in engines}
    for r in range(repeats):
        for name, engine in engines.items():
            results[name].append(measure(engine, name, r))
    return results


def warm_ttft(engines: dict[str, LLMEngine], source: TextSource, tokens: int, repeats: int) -> dict[str, float]:
    tok = next(iter(engines.values())).tokenizer
    messages = conversation(tok, source, tokens, "In one sentence, what is the main event described above?")
    for name, engine in engines.items():
        engine_ttft(engine, f"cold-{name}", chat_ids(tok, messages))

    def measure(engine, name, r):
        question = f"Question {r + 1}: name one place mentioned in the text above."
        return engine_ttft(engine, f"warm-{name}-{r}-{time.monotonic_ns()}", chat_ids(tok, with_last_line(messages, question)))

    return {name: statistics.median(v) for name, v in alternate(engines, measure, repeats).items()}


def decode_speed(engines: dict[str, LLMEngine], batch: int, context: int, tokens: int, repeats: int):
    def measure(engine, name, r):
        speed = ours_decode(engine, batch, context, tokens)
        engine.sampler.first_logits.clear()
        return speed

    return {name: max(v) for name, v in alternate(engines, measure, repeats).items()}


# ---- blending: re-RoPE on quantized keys ------------------------------------------------------------------
def prompt_keys(engine: LLMEngine, rid: str, ids: list[int]) -> torch.Tensor:
    """Every layer's post-RoPE keys [layers, n, heads, dim] of the prompt's full blocks, computed from
    position 0 on the engine's pool (filed in its prefix cache, read back through it)."""
    run_one(engine, rid, ids, [], blend=False, ratio=None, max_tokens=1, prefix_cache=True)
    engine.sampler.first_logits.clear()
    bs = engine.pool.block_size
    full = (len(ids) - 1) // bs * bs
    match = engine.cache.match(ids[:full], b"", record_stats=False)
    slots = torch.tensor([match.block_ids[p // bs] * bs + p % bs for p in range(full)])
    return torch.stack([k.float() for k in engine.pool.read_keys(slots)])


def blend_key_deviation(engine: LLMEngine, case, inv_freq: torch.Tensor) -> float:
    """What blending itself changes in a reused key, for scale: a passage's keys computed alone (after the
    template's opening) and moved to where the passage sits in a prompt, against the keys a full prefill of
    that prompt computes there (relative RMS over every layer; layer 0 agrees exactly)."""
    tok = engine.tokenizer
    lead = template_lead(tok)
    ids, spans = prompt_for(tok, case.passages)
    start, n = spans[1]  # a passage that other text precedes
    in_context = prompt_keys(engine, "dev-full", ids)[:, start:start + n]
    alone_ids = lead + list(ids[start:start + n])
    alone = prompt_keys(engine, "dev-alone", alone_ids + [alone_ids[-1]])[:, len(lead):len(lead) + n]
    n = min(alone.shape[1], in_context.shape[1])
    positions = torch.arange(len(lead), len(lead) + n)
    moved = torch.stack([rerope_dense(k[:n], start - len(lead), inv_freq, old_pos=positions) for k in alone])
    return float((moved - in_context[:, :n]).norm() / in_context[:, :n].norm())


def rerope_errors(keys: list[torch.Tensor], dtype: str, shifts: list[int], inv_freq: torch.Tensor) -> dict:
    """Relative RMS error, against the exact key at the new position, of a key stored in `dtype` at position
    p and moved to p + shift: requantized after the rotation (the pool's update_keys with blend's moved_keys), kept unrotated (stored
    before RoPE, rotated when read), and, for scale, quantized fresh at the new position."""
    n, heads, dim = keys[0].shape
    layers = len(keys)
    bs = 16

    def stored(values: list[torch.Tensor]) -> tuple[KVPool, torch.Tensor]:
        pool = KVPool(layers, -(-n // bs), bs, heads, dim, dtype)
        slots = torch.arange(n)
        for layer, k in enumerate(values):
            pool.write(layer, slots, k, torch.zeros_like(k))
        return pool, slots

    err = {"requantized": [], "unrotated": [], "fresh": []}
    positions = torch.arange(n)
    for shift in shifts:
        new = positions + shift
        exact = [rerope_dense(k, shift, inv_freq, old_pos=positions) for k in keys]
        pool, slots = stored(keys)
        pool.update_keys(slots, moved_keys(positions, new, inv_freq))
        err["requantized"].append(pool.read_keys(slots))
        pool, slots = stored([unrope(k, positions, inv_freq) for k in keys])
        err["unrotated"].append([apply_rope(k.float(), new, inv_freq) for k in pool.read_keys(slots)])
        pool, slots = stored(exact)
        err["fresh"].append(pool.read_keys(slots))
        for name in err:
            got = err[name].pop()
            num = sum(float((g.float() - e).pow(2).sum()) for g, e in zip(got, exact))
            den = sum(float(e.pow(2).sum()) for e in exact)
            err[name].append((num / den) ** 0.5)
    return {f"rerope_key_err_{name}": round(statistics.fmean(v), 5) for name, v in err.items()}


# ---- tiers in a smaller dtype -----------------------------------------------------------------------------
def tier_round_trip_kl(engine: LLMEngine, prompts: list[list[int]], tier_dtypes: list[str]) -> dict:
    """The fp32 pool's cached prompt blocks exported in a tier dtype and imported back (what --tier-kv-dtype
    does to a block that leaves the pool and returns): first-token KL of a warm request against the same
    request over the untouched blocks."""
    kls = {t: [] for t in tier_dtypes}
    bs = engine.pool.block_size
    for i, ids in enumerate(prompts):
        engine.cache.reset_prefix_cache()
        first_logits(engine, f"tc{i}", ids, prefix_cache=True)  # files the prompt's blocks
        follow = ids[:-1] + [ids[-1]]  # the same prompt again: all but its last token from the cache
        blocks = engine.cache.match(ids[:(len(ids) - 1) // bs * bs], b"", record_stats=False).block_ids
        original = engine.pool.export_blocks(blocks)
        reference = first_logits(engine, f"tr{i}", follow, prefix_cache=True)
        for tier in tier_dtypes:
            engine.pool.import_blocks(blocks, engine.pool.export_blocks(blocks, as_dtype=tier), engine.pool.layout_for(tier))
            kls[tier].append(kl(reference, first_logits(engine, f"t{tier}{i}", follow, prefix_cache=True)))
            engine.pool.import_blocks(blocks, original)
    return {t: dict(tier_bytes_per_block=engine.pool.layout_for(t).nbytes, tier_first_token_kl_median=statistics.median(v))
            for t, v in kls.items()}


# ---- the fp32 kernel against an earlier revision's --------------------------------------------------------
def reference_kernel(rev: str) -> cpu_attention.CpuAttentionKernel:
    """The attention kernel as of git revision `rev`, built with the same flags, for an A/B in one process."""
    folder = Path(tempfile.mkdtemp(prefix="kernel-ref-"))
    for name in ("cpu_attention.cpp", "cpu_vector.h"):
        source = subprocess.run(["git", "show", f"{rev}:reuse_server/model/{name}"], cwd=REPO, check=True,
                                capture_output=True).stdout
        (folder / name).write_bytes(source)
    flags = [f for f in native.FLAGS]
    subprocess.run(["g++", *flags, str(folder / "cpu_attention.cpp"), "-o", str(folder / "ref.so")], check=True)
    library = ctypes.CDLL(str(folder / "ref.so"))
    fn = library.kv_paged_attention_f32
    fn.argtypes, fn.restype = native.SIGNATURES["kv_paged_attention_f32"]
    kernel = cpu_attention.CpuAttentionKernel.__new__(cpu_attention.CpuAttentionKernel)
    kernel._fn = fn
    return kernel


def kernel_ab(engine: LLMEngine, rev: str, source: TextSource, tokens: int, repeats: int) -> dict:
    ours = engine.model.backend.attention
    theirs = reference_kernel(rev)
    tok = engine.tokenizer
    messages = conversation(tok, source, tokens, "In one sentence, what is the main event described above?")
    engine_ttft(engine, "ab-cold", chat_ids(tok, messages))
    times = {"ref": [], "ours": []}
    for r in range(repeats):
        for name, kernel in (("ref", theirs), ("ours", ours)):
            engine.model.backend.attention = kernel
            question = f"Question {r + 1} {name}: name one place mentioned in the text above."
            times[name].append(engine_ttft(engine, f"ab-{name}-{r}", chat_ids(tok, with_last_line(messages, question))))
    engine.model.backend.attention = ours
    ref, new = statistics.median(times["ref"]), statistics.median(times["ours"])
    return dict(bench="kernel_ab_fp32_warm_ttft", ref_rev=rev, tokens=tokens, repeats=repeats,
                ref_ms=round(ref * 1e3, 2), ours_ms=round(new * 1e3, 2), ours_over_ref=round(new / ref, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp16,bf16,fp8_e4m3,int8", help="KV dtypes measured against fp32")
    ap.add_argument("--kv-cache-memory", type=int, default=320 << 20, help="each engine's pool, bytes")
    ap.add_argument("--kl-prompts", type=int, default=16)
    ap.add_argument("--kl-words", type=int, default=500)
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-tokens", type=int, default=256)
    ap.add_argument("--needle-cases", type=int, default=30)
    ap.add_argument("--needle-ratio", type=float, default=0.15)
    ap.add_argument("--ttft-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-context", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--tier-dtypes", default="bf16,fp8_e4m3,int8")
    ap.add_argument("--rerope-shifts", default="37,500,2000")
    ap.add_argument("--ab-kernel-ref", default=None, help="git revision whose fp32 attention kernel to A/B against")
    ap.add_argument("--speed-only", action="store_true", help="sizes, warm TTFT and decode speed only (no quality)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not DOCS.exists():
        raise SystemExit(f"needs {DOCS} (the shared data folder beside the repository)")
    torch.manual_seed(0)
    rows = []
    base = make_engine("fp32", args.kv_cache_memory)
    tok = base.tokenizer
    mc = base.model_config
    source = TextSource(tok)
    quality = not args.speed_only
    prompts = text_prompts(tok, args.kl_prompts, args.kl_words)
    cases = make_cases(args.needle_cases, 4, 0, 200)
    inv_freq = base.model.rotary.inv_freq.float().cpu()

    if args.ab_kernel_ref:
        rows.append(emit(**kernel_ab(base, args.ab_kernel_ref, source, args.ttft_tokens, max(args.repeats, 5))))

    if quality:
        keys = list(prompt_keys(base, "keys", prompts[0]))
        rows.append(emit(bench="blend_key_deviation",
                         relative_rms=round(blend_key_deviation(base, cases[0], inv_freq), 4)))
        ref_logits = [first_logits(base, f"kl-fp32-{i}", ids) for i, ids in enumerate(prompts)]
        ref_greedy = greedy(base, prompts[:args.greedy_prompts], args.greedy_tokens, "fp32")
        rows.append(emit(bench="kv_dtype", kv_dtype="fp32", bytes_per_token=base.pool.bytes_per_token,
                         tokens_per_gib=int(2**30 / base.pool.bytes_per_token), first_token_kl_median=0.0,
                         greedy_prefix_agreement=1.0, **needle(base, cases, args.needle_ratio, 16, "fp32")))
        for name, value in tier_round_trip_kl(base, prompts, args.tier_dtypes.split(",")).items():
            rows.append(emit(bench="tier_kv_dtype", pool="fp32", tier_kv_dtype=name, **value))

    for kv_dtype in args.dtypes.split(","):
        engine = make_engine(kv_dtype, args.kv_cache_memory)
        row = dict(bench="kv_dtype", kv_dtype=kv_dtype, bytes_per_token=engine.pool.bytes_per_token,
                   tokens_per_gib=int(2**30 / engine.pool.bytes_per_token),
                   pool_blocks=engine.pool.num_blocks, fp32_pool_blocks=base.pool.num_blocks)
        if quality:
            kls = [kl(ref, first_logits(engine, f"kl-{kv_dtype}-{i}", ids))
                   for i, (ref, ids) in enumerate(zip(ref_logits, prompts))]
            row.update(first_token_kl_median=statistics.median(kls), first_token_kl_max=max(kls),
                       **agreement(ref_greedy, greedy(engine, prompts[:args.greedy_prompts], args.greedy_tokens,
                                                      kv_dtype)),
                       **needle(engine, cases, args.needle_ratio, 16, kv_dtype),
                       **rerope_errors(keys, kv_dtype, [int(s) for s in args.rerope_shifts.split(",")], inv_freq))
        pair = {"fp32": base, kv_dtype: engine}
        ttft = warm_ttft(pair, source, args.ttft_tokens, args.repeats)
        row.update(warm_ttft_ms=round(ttft[kv_dtype] * 1e3, 2), warm_ttft_fp32_ms=round(ttft["fp32"] * 1e3, 2),
                   warm_ttft_over_fp32=round(ttft[kv_dtype] / ttft["fp32"], 3))
        for batch in (1, 8):
            speed = decode_speed(pair, batch, args.decode_context, args.decode_tokens, args.repeats)
            row.update({f"decode_b{batch}_tok_s": round(speed[kv_dtype], 1),
                        f"decode_b{batch}_fp32_tok_s": round(speed["fp32"], 1),
                        f"decode_b{batch}_over_fp32": round(speed[kv_dtype] / speed["fp32"], 3)})
        rows.append(emit(**row))
        del engine, pair
        gc.collect()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
