"""Needle in passages: does blending keep answers right while skipping most of the prefill?

Each case: k passages of a few hundred tokens from the Lee background corpus, one carrying a planted
fact ("The access code for the Orion project is NNNN."), then the question, in SmolLM2's chat template
with an assistant turn that starts "Answer:". Passages are precomputed through the chunk index (alone,
right after the template opening), then served in a new order (by default with the exact prefix cache on,
as served, so the template opening and the passage that comes first are exact hits; --no-prefix-cache
measures blending alone). For full prefill, naive reuse (ratio 0) and selective
recompute ratios, report answer accuracy, the KL divergence of the first answer token against full
prefill, greedy agreement of the first tokens, and time to first token (the prefill step).
Every config of a case runs right after the others (full prefill, then each blended config, ...), so a change
in the machine's load hits them alike; besides the median TTFTs each row reports the median over cases of that
case's own full-prefill/config TTFT ratio, and the 1-minute load average (/proc/loadavg) read around its runs.
Progress goes to stderr, so stdout is one JSON row per config.
--selections runs each ratio under several selection strategies (cacheblend, epic, a3: blend/strategies.py)
on the same cases and engine; each spends the same budget, ceil(ratio * reused tokens), per prompt.

    .venv/bin/python -m benchmarks.bench_blend [--cases 100] [--ratios 0,0.05,0.15,0.3] [--out FILE.json]
    .venv/bin/python -m benchmarks.bench_blend --glued [--fill traffic]   # passages glued into one string
    .venv/bin/python -m benchmarks.bench_blend --ratios 0.05,0.15 --selections cacheblend,epic,a3
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from blend.chunking import encode, render_chat_chunks
from blend.strategies import SELECTIONS, ChunkStarts, Deviation, QuestionAttention
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampler import Sampler
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

_CORPUS = Path("shared") / "data" / "docs" / "lee_background.cor"
# the shared data folder beside the repository, or beside a folder above it (a git worktree's)
DOCS = next((p / _CORPUS for p in Path(__file__).resolve().parents[1:] if (p / _CORPUS).exists()),
            Path(__file__).resolve().parents[1].parent / _CORPUS)
QUESTION = "What is the access code for the Orion project?"
ANSWER_PREFIX = "Answer:"
FIRST_TOKENS = 5


class CapturingSampler(Sampler):
    """Keeps the logits each request's first token was sampled from (for KL against full prefill)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_logits: dict[str, torch.Tensor] = {}

    def pick(self, logits, states, params, histories=None):
        for row, state in enumerate(states):
            self.first_logits.setdefault(state.request_id, logits[row].float().clone())
        return super().pick(logits, states, params, histories)


@dataclass
class Case:
    passages: list[str]
    code: str


def load_articles(min_words: int, max_words: int) -> list[str]:
    articles = []
    for line in DOCS.read_text().splitlines():
        words = line.split()
        if len(words) >= min_words:
            articles.append(" ".join(words[:max_words]))
    return articles


def plant(article: str, fact: str, rng: random.Random) -> str:
    sentences = re.split(r"(?<=[.!?]) ", article)
    at = rng.randrange(1, max(2, len(sentences)))
    return " ".join(sentences[:at] + [fact] + sentences[at:])


def make_cases(n: int, k: int, seed: int, max_words: int) -> list[Case]:
    rng = random.Random(seed)
    articles = load_articles(min_words=max_words // 2, max_words=max_words)
    cases = []
    for _ in range(n):
        chosen = rng.sample(articles, k)
        code = f"{rng.randrange(1000, 10000)}"
        needle = rng.randrange(k)
        chosen[needle] = plant(chosen[needle], f"The access code for the Orion project is {code}.", rng)
        cases.append(Case(chosen, code))
    return cases


def prompt_for(tokenizer, passages: list[str], glued: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """The chat prompt: passages and question as text parts, or (glued) joined by blank lines into one
    string, as a RAG pipeline that marks nothing sends them."""
    if glued:
        content = "\n\n".join(passages + [QUESTION])
    else:
        content = [{"type": "text", "text": p} for p in passages] + [{"type": "text", "text": QUESTION}]
    chunks = render_chat_chunks(tokenizer, [{"role": "user", "content": content}])
    ids, spans = [], []
    for c in chunks:
        if c.reusable:
            spans.append((len(ids), len(c.tokens)))
        ids.extend(c.tokens)
    return ids + list(encode(tokenizer, ANSWER_PREFIX)), spans


def run_one(engine: LLMEngine, rid: str, ids, spans, blend: bool, ratio: float | None, max_tokens: int,
            prefix_cache: bool = False, selection=None):
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                       CacheOptions(prefix_cache=prefix_cache, chunk_spans=spans, blend=blend, recompute_ratio=ratio,
                                    blend_selection=selection))
    out_ids, first, last = [], None, None
    t0 = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            if first is None:
                first = time.perf_counter() - t0
            out_ids += out.new_token_ids
            last = out
    return out_ids, first, last


def load_average() -> float:
    """The machine's 1-minute load average: TTFTs on a shared CPU are read against it."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def template_lead(tokenizer) -> list[int]:
    """The template's framing before the first passage: a precomputed chunk can be computed after it, so it
    sees the same attention sink (the prompt's first tokens) it will see when reused."""
    probe_ids, probe_spans = prompt_for(tokenizer, ["x"])
    return probe_ids[:probe_spans[0][0]]


def precompute_passages(engine: LLMEngine, passages: list[str], head: list[int], tag: str) -> None:
    """File each passage in the chunk index, computed alone after `head` (POST /v1/cache/chunks)."""
    for j, passage in enumerate(passages):
        t = list(encode(engine.tokenizer, passage))
        engine.precompute(f"pre{tag}-{j}", head + t, CacheOptions(chunk_spans=[(len(head), len(t))], blend=False))
    while engine.has_work():
        engine.step()


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--max-words", type=int, default=200)
    ap.add_argument("--ratios", default="0,0.05,0.15,0.3")
    ap.add_argument("--check-layers", default="1")
    ap.add_argument("--gradual-factors", default="1")
    ap.add_argument("--score", default="kv")
    ap.add_argument("--selections", default="cacheblend",
                    help="comma-separated selection strategies, each run at every ratio: " + ", ".join(SELECTIONS))
    ap.add_argument("--first-tokens", type=int, default=0, help="epic: each chunk's first N tokens (0: the ratio)")
    ap.add_argument("--query-weight", type=float, default=0.0, help="cacheblend: the question's attention weight")
    ap.add_argument("--key-shift", action=argparse.BooleanOptionalAction, default=True,
                    help="the server's --blend-key-shift (default on); --no-key-shift: plain CacheBlend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--precompute-after-template", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--fill", choices=["precompute", "traffic"], default="precompute",
                    help="how passages reach the chunk index: precomputed alone (POST /v1/cache/chunks), or from "
                         "one earlier ordinary request with the passages in another order (its first passage is "
                         "filed alone, the others in context)")
    ap.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="blended requests also use the exact prefix cache, as served (the template opening, and "
                         "the passage precomputed right after it that comes first, are then exact hits); full "
                         "prefill never does. --no-prefix-cache measures blending alone")
    ap.add_argument("--prefix-only", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the exact prefix cache without blending (with --prefix-cache); "
                         "--no-prefix-only skips that second near-full prefill per case on a slow machine")
    ap.add_argument("--glued", action="store_true",
                    help="send each prompt's passages and question as ONE string, blank lines between them, not as "
                         "text parts: blending must find the passages by their content (--blend-chunk-tokens)")
    ap.add_argument("--chunk-tokens", type=int, default=64, help="the server's --blend-chunk-tokens (0: off)")
    ap.add_argument("--weight-dtype", default="auto", help="how the engine holds its weights (--weight-dtype)")
    ap.add_argument("--model", default=None, help="the server's --model (default: the bundled SmolLM2)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not DOCS.exists():
        raise SystemExit(f"needs {DOCS} (the shared data folder beside the repository)")
    torch.manual_seed(0)
    engine = build_engine(EngineConfig(model=args.model, weight_dtype=args.weight_dtype,
        max_num_batched_tokens=8192, kv_cache_memory=2 << 30, enable_blend=False,
        blend_check_layers=tuple(int(x) for x in args.check_layers.split(",")),
        blend_gradual_factors=tuple(float(x) for x in args.gradual_factors.split(",")),
        blend_score=args.score, blend_min_tokens=16, blend_key_shift=args.key_shift,
        blend_chunk_tokens=args.chunk_tokens))
    engine.sampler = sampler = CapturingSampler()
    tok = engine.tokenizer
    ratios = [float(r) for r in args.ratios.split(",")]
    strategies = {"cacheblend": Deviation(args.query_weight), "epic": ChunkStarts(args.first_tokens),
                  "a3": QuestionAttention()}
    selections = [strategies[s] for s in args.selections.split(",")]
    # (name, blend, ratio, prefix cache, selection); full prefill never uses the cache. "prefix only" (exact
    # prefix caching without blending) runs last: it files exact KV of the whole prompt that others would hit.
    configs = [("full", False, None, False, None)] + [
        (f"ratio={r:g}" if len(selections) == 1 else f"{s.name} ratio={r:g}", True, r, args.prefix_cache, s)
        for r in ratios for s in selections]
    if args.prefix_cache and args.prefix_only:
        configs.append(("prefix only", False, None, True, None))
    results = {name: dict(correct=0, kl=[], agree=[], ttft=[], blended=0, recomputed=0, prefix=0, prompt=0,
                     load=[])
               for name, *_ in configs}
    cases = make_cases(args.cases, args.passages, args.seed, args.max_words)
    lead = template_lead(tok)
    for i, case in enumerate(cases):
        if args.fill == "traffic":
            first_ids, first_spans = prompt_for(tok, case.passages, args.glued)
            engine.add_request(f"pre{i}", first_ids, SamplingParams(max_tokens=1),
                               CacheOptions(chunk_spans=first_spans, blend=True, prefix_cache=False))
        # precompute through the chunk index
        precompute_passages(engine, case.passages if args.fill == "precompute" else [],
                            lead if args.precompute_after_template else [], str(i))
        while engine.has_work():
            engine.step()
        order = case.passages[:]
        random.Random(args.seed * 1000 + i).shuffle(order)
        ids, spans = prompt_for(tok, order, args.glued)
        ref_ids = None
        for name, blend, ratio, prefix_cache, selection in configs:
            rid = f"{name}-{i}"
            load_before = load_average()
            out_ids, ttft, last = run_one(engine, rid, ids, spans, blend, ratio, args.max_tokens,
                                          prefix_cache=prefix_cache, selection=selection)
            text = tok.decode(out_ids, skip_special_tokens=True)
            r = results[name]
            r["correct"] += case.code in text
            r["ttft"].append(ttft)
            r["load"].append((load_before, load_average()))
            r["blended"] += last.blended_tokens
            r["recomputed"] += last.recomputed_tokens
            r["prefix"] += last.cached_tokens - last.blended_tokens
            r["prompt"] += len(ids)
            if name == "full":
                ref_ids, ref_logits = out_ids, sampler.first_logits[rid]
            r["kl"].append(kl(ref_logits, sampler.first_logits[rid]))
            r["agree"].append(out_ids[:FIRST_TOKENS] == ref_ids[:FIRST_TOKENS])
            sampler.first_logits.pop(rid)
        if (i + 1) % 10 == 0:
            print(f"{i + 1} cases: " + ", ".join(f"{n} {results[n]['correct']}" for n, *_ in configs),
                  file=sys.stderr, flush=True)
        if args.out and i + 1 < len(cases):  # a run stopped early (a loaded machine) keeps every case it measured
            Path(args.out).write_text(json.dumps(summarize(results, configs, i + 1, args), indent=1))
    rows = summarize(results, configs, len(cases), args)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def summarize(results: dict, configs: list, n: int, args) -> list[dict]:
    """One row per config over the first n cases."""
    full_ttft = statistics.median(results["full"]["ttft"])
    rows = []
    for name, _, ratio, _, selection in configs:
        r = results[name]
        # each case's full prefill ran next to this config's run of it: their ratio cancels the load both saw
        per_case = [f / t for f, t in zip(results["full"]["ttft"], r["ttft"])]
        loads = [x for pair in r["load"] for x in pair]
        quartiles = statistics.quantiles(per_case, n=4, method="inclusive") if n > 1 else per_case * 3
        rows.append(dict(
            config=name, selection=selection.key() if selection else None, ratio=ratio, cases=n,
            accuracy=round(r["correct"] / n, 4),
            kl_median=round(statistics.median(r["kl"]), 4), kl_mean=round(statistics.fmean(r["kl"]), 4),
            first_tokens_agree=round(sum(r["agree"]) / n, 4),
            ttft_median_s=round(statistics.median(r["ttft"]), 4),
            ttft_speedup=round(full_ttft / statistics.median(r["ttft"]), 2),
            ttft_speedup_case_median=round(statistics.median(per_case), 2),
            ttft_speedup_case_quartiles=[round(q, 2) for q in quartiles],
            ttft_per_case_s=[round(t, 4) for t in r["ttft"]],  # in case order: shows a cost that grows run-long
            loadavg=dict(start=r["load"][0][0], end=r["load"][-1][1], min=min(loads), max=max(loads)),
            prefix_hit_share=round(r["prefix"] / r["prompt"], 4), blended_share=round(r["blended"] / r["prompt"], 4),
            recomputed_share=round(r["recomputed"] / r["prompt"], 4),
            mean_prompt_tokens=round(r["prompt"] / n),
            settings=dict(check_layers=args.check_layers, gradual_factors=args.gradual_factors, score=args.score,
                          key_shift=args.key_shift,
                          precompute_after_template=args.precompute_after_template, fill=args.fill,
                          prefix_cache=args.prefix_cache, model=args.model or "smollm2", glued=args.glued,
                          chunk_tokens=args.chunk_tokens)))
    return rows


if __name__ == "__main__":
    main()
