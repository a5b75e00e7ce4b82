"""How much of a reordered glued prompt each way of finding chunks can reuse (tokenizer only, no model).

The needle cases of bench_blend (k passages joined by blank lines into one string, then the question) are
filed once in one order (as an earlier prompt would file them: its one span cut by blend/content_cuts.py)
and then looked for in another order, two ways:
- cuts only: the new prompt is cut the same way and a chunk is reused where its tokens equal a filed chunk's;
- every offset: the new prompt is searched at every offset for a filed chunk beginning there (what the
  server does: ChunkIndex.starts), and the chunk found is reused where all its tokens match.
Reports the share of prompt tokens reused, per average chunk length (--blend-chunk-tokens).

    .venv/bin/python -m benchmarks.bench_glued_cuts [--cases 30] [--passages 4]
"""
from __future__ import annotations

import argparse
import random

from transformers import AutoTokenizer

from benchmarks.bench_blend import QUESTION, make_cases
from blend.chunking import encode
from blend.content_cuts import ContentDefinedCuts
from reuse_server.model.bundled import bundled_gguf_path


def glued_ids(tok, passages: list[str]) -> list[int]:
    return list(encode(tok, "\n\n".join(passages + [QUESTION])))


def reused_by_cuts(cuts: ContentDefinedCuts, filed: list[int], ids: list[int]) -> int:
    chunks = {tuple(filed[s:s + n]) for s, n in cuts.pieces(filed)}
    return sum(n for s, n in cuts.pieces(ids) if tuple(ids[s:s + n]) in chunks)


def reused_at_any_offset(cuts: ContentDefinedCuts, filed: list[int], ids: list[int], block: int = 16) -> int:
    by_first_block: dict[tuple, list[tuple]] = {}
    for s, n in cuts.pieces(filed):
        by_first_block.setdefault(tuple(filed[s:s + block]), []).append(tuple(filed[s:s + n]))
    reused = pos = 0
    while pos < len(ids):
        found = [len(c) for c in by_first_block.get(tuple(ids[pos:pos + block]), []) if tuple(ids[pos:pos + len(c)]) == c]
        step = max(found, default=0)
        reused += step
        pos += step or 1
    return reused


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--chunk-tokens", default="48,64,96")
    ap.add_argument("--min-tokens", type=int, default=32)
    args = ap.parse_args()
    gguf = bundled_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cases = make_cases(args.cases, args.passages, 0, 200)
    for average in (int(x) for x in args.chunk_tokens.split(",")):
        cuts = ContentDefinedCuts.around(average, args.min_tokens)
        total = by_cuts = any_offset = 0
        for i, case in enumerate(cases):
            filed = glued_ids(tok, case.passages)
            order = case.passages[:]
            random.Random(i).shuffle(order)
            ids = glued_ids(tok, order)
            total += len(ids)
            by_cuts += reused_by_cuts(cuts, filed, ids)
            any_offset += reused_at_any_offset(cuts, filed, ids)
        print(f"chunks of ~{average} tokens ({cuts.min_tokens}-{cuts.max_tokens}): reused share "
              f"cuts only {by_cuts / total:.3f}, every offset {any_offset / total:.3f} "
              f"({args.cases} cases, {args.passages} passages, {total / len(cases):.0f} tokens)")


if __name__ == "__main__":
    main()
