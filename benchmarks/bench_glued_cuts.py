"""How much of a reordered glued prompt each way of finding chunks can reuse (tokenizer only, no model).

The needle cases of bench_blend (k passages joined by blank lines into one string, then the question) are
filed once in one order (as an earlier prompt would file them: its one span cut by blend/content_cuts.py)
and then looked for in another order, two ways:
- cuts only: the new prompt is cut the same way and a chunk is reused where its tokens equal a filed chunk's;
- every offset: the new prompt is searched at every offset for a filed chunk beginning there (what the
  server does: ChunkIndex.starts), and the chunk found is reused where all its tokens match;
and both again with the prompt first cut at its blank lines (ParagraphCuts, what the server does).
Reports the share of prompt tokens reused, per average chunk length (--blend-chunk-tokens).

    .venv/bin/python -m benchmarks.bench_glued_cuts [--cases 30] [--passages 4]
"""
from __future__ import annotations

import argparse
import random

from transformers import AutoTokenizer

from benchmarks.bench_blend import QUESTION, make_cases
from blend.chunking import encode, whitespace_tokens
from blend.content_cuts import ContentDefinedCuts, ParagraphCuts, SpanCuts
from reuse_server.model.bundled import bundled_gguf_path


def glued_ids(tok, passages: list[str]) -> list[int]:
    return list(encode(tok, "\n\n".join(passages + [QUESTION])))


def pieces(cuts: SpanCuts, ids: list[int]) -> list[tuple[int, int]]:
    return cuts.cut(ids, [(0, len(ids))])


def reused_by_cuts(cuts: SpanCuts, filed: list[int], ids: list[int], min_tokens: int) -> int:
    chunks = {tuple(filed[s:s + n]) for s, n in pieces(cuts, filed) if n >= min_tokens}
    return sum(n for s, n in pieces(cuts, ids) if tuple(ids[s:s + n]) in chunks)


def reused_at_any_offset(cuts: SpanCuts, filed: list[int], ids: list[int], min_tokens: int, block: int = 16) -> int:
    by_first_block: dict[tuple, list[tuple]] = {}
    for s, n in pieces(cuts, filed):
        if n < min_tokens:
            continue
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
    newlines = whitespace_tokens(tok)
    for average in (int(x) for x in args.chunk_tokens.split(",")):
        content = ContentDefinedCuts.around(average, args.min_tokens)
        for name, cuts in (("content cuts", content), ("blank lines, then content cuts", ParagraphCuts(content, newlines))):
            total = by_cuts = any_offset = 0
            for i, case in enumerate(cases):
                filed = glued_ids(tok, case.passages)
                order = case.passages[:]
                random.Random(i).shuffle(order)
                ids = glued_ids(tok, order)
                total += len(ids)
                by_cuts += reused_by_cuts(cuts, filed, ids, args.min_tokens)
                any_offset += reused_at_any_offset(cuts, filed, ids, args.min_tokens)
            print(f"{name}, chunks of ~{average} tokens ({content.min_tokens}-{content.max_tokens}): reused share "
                  f"cuts only {by_cuts / total:.3f}, every offset {any_offset / total:.3f} "
                  f"({args.cases} cases, {args.passages} passages, {total / len(cases):.0f} tokens)")


if __name__ == "__main__":
    main()
