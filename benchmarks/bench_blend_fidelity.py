"""What deviation do reused chunks show at the first check layer? The measurement behind --blend-max-deviation.

With the fidelity check off, the bundled model blends prompts of two kinds and records every reused chunk's
relative K and V deviation (blend/fidelity.py) at the first check layer:
- real: the needle cases of bench_blend (Lee corpus passages, precomputed alone, served in a new order as
  text parts and glued into one message): chunks that must keep blending;
- garbage: random words, "hi hi hi ...", a chunk spliced from halves of two unrelated passages, and a passage
  filed after a very different prefix (a run of one repeated word) then reused after a real passage.
A threshold between the two groups rejects the second and keeps the first.

    .venv/bin/python -m benchmarks.bench_blend_fidelity [--cases 5] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from benchmarks.bench_blend import (load_articles, make_cases, precompute_passages, prompt_for, run_one,
                                    template_lead)
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig

# a threshold no chunk reaches: the check measures every chunk (inf would skip it) and rejects none
OBSERVE_ONLY = 1e9


class DeviationLog:
    """Every blend job's chunk deviations, read as the job closes (Blender.finish)."""

    def __init__(self, blender):
        self.rows: list[tuple[str, int, float, float]] = []
        self.tag = ""
        finish = blender.finish

        def recording(seq):
            job = finish(seq)
            if job is not None and job.deviation is not None:
                for (_, n), (k, v) in zip(job.chunks, job.deviation.relative().tolist()):
                    if k or v:  # a chunk no check layer saw (all of it in the exact prefix) has no figure
                        self.rows.append((self.tag, n, k, v))
            return job

        blender.finish = recording


def serve(engine, log: DeviationLog, tag: str, passages: list[str], glued: bool = False) -> None:
    log.tag = tag
    ids, spans = prompt_for(engine.tokenizer, passages, glued)
    run_one(engine, f"{tag}-{len(log.rows)}-{random.random()}", ids, spans, True, 0.15, 1, prefix_cache=True)


def summary(rows, tag: str) -> dict:
    ks = [k for t, _, k, _ in rows if t == tag]
    vs = [v for t, _, _, v in rows if t == tag]
    ds = [max(k, v) for t, _, k, v in rows if t == tag]
    if not ds:
        return {"kind": tag, "chunks": 0}
    q = statistics.quantiles(ds, n=20) if len(ds) > 1 else [ds[0]] * 19
    return {"kind": tag, "chunks": len(ds), "min": min(ds), "p5": q[0], "median": statistics.median(ds),
            "p95": q[-1], "max": max(ds), "k_median": statistics.median(ks), "v_median": statistics.median(vs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    engine = build_engine(EngineConfig(model=args.model, max_num_batched_tokens=8192, kv_cache_memory=2 << 30,
                                       blend_min_tokens=16, blend_max_deviation=OBSERVE_ONLY))
    log = DeviationLog(engine.blender)
    tok = engine.tokenizer
    lead = template_lead(tok)
    rng = random.Random(args.seed)
    words = sorted({w for a in load_articles(100, 200) for w in a.split()})
    articles = load_articles(100, 200)
    for i, case in enumerate(make_cases(args.cases, 4, args.seed, 200)):
        precompute_passages(engine, case.passages, lead, f"real{i}")
        order = case.passages[:]
        rng.shuffle(order)
        serve(engine, log, "real parts", order)
        rng.shuffle(order)
        serve(engine, log, "real glued", order, glued=True)

        noise = [" ".join(rng.choice(words) for _ in range(150)) for _ in range(2)]
        precompute_passages(engine, noise, lead, f"noise{i}")
        serve(engine, log, "random words", [case.passages[0]] + noise[::-1])

        word = rng.choice(["hi", "the", "ok", "yes", "data"])
        repeated = " ".join([word] * rng.randrange(150, 250))
        precompute_passages(engine, [repeated], lead, f"rep{i}")
        serve(engine, log, "repeated word", [case.passages[1], repeated])

        a, b = rng.sample(articles, 2)
        wa, wb = a.split(), b.split()
        spliced = " ".join(wa[:len(wa) // 2] + wb[len(wb) // 2:])
        precompute_passages(engine, [spliced], lead, f"splice{i}")
        serve(engine, log, "spliced", [case.passages[2], spliced])

        # filed as the second part after a run of one word (so in that context, not alone), then reused
        # after a real passage
        other = rng.choice(articles)
        log.tag = "filing"
        serve(engine, log, "filing", [" ".join(["zero"] * 200), other])
        serve(engine, log, "after another prefix", [case.passages[3], other])
        print(f"{i + 1} cases", flush=True)
    rows = [summary(log.rows, tag) for tag in ("real parts", "real glued", "random words", "repeated word",
                                               "spliced", "after another prefix")]
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": rows, "chunks": log.rows}, f, indent=1)


if __name__ == "__main__":
    main()
