"""Where a prompt's client-marked spans are cut into the chunks blending looks up and registers.

A client marks chunks by how it sends text (messages, text parts, `--blend-separator` pieces, documents sent to
/v1/cache/chunks); a RAG pipeline that glues its passages into one message marks nothing. So the spans are cut
again, by their content: a rolling hash over a window of tokens decides where a cut may fall, and the same
tokens give the same cuts wherever they stand (the same idea as content-defined chunking in backup tools, on
token ids). A passage glued into a message at another offset, after other passages, cuts where it cut when it
was sent alone or in another order once the first cut inside it falls where it fell before (a few dozen tokens
in), and from there on its chunks have the tokens, and so the chunk index keys, of the chunks filed earlier.

Three variants: `WholeSpans` (the client's spans as they are), `ContentDefinedCuts`, and `ParagraphCuts`, which
cuts at blank lines first and hands each paragraph to another variant. Spans are cut independently of each
other: messages and text parts stay boundaries. Pure Python over token ids; no server import.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import xxhash

Span = tuple[int, int]  # (prompt position, length)


class SpanCuts(Protocol):
    def cut(self, tokens: Sequence[int], spans: Sequence[Span]) -> list[Span]:
        """The chunks of `spans` (spans of `tokens`), in prompt order."""


class WholeSpans:
    """Only the client's spans: each is one chunk."""

    def cut(self, tokens: Sequence[int], spans: Sequence[Span]) -> list[Span]:
        return [tuple(s) for s in spans]


@dataclass(frozen=True)
class ContentDefinedCuts:
    """Cut each span where the hash of the `window` tokens before the cut is 0 modulo (average - min): a cut
    candidate depends on those tokens alone. A chunk is at least `min_tokens` long (shorter ones would not be
    reused: the chunk index ignores them) and at most `max_tokens` (a long stretch with no candidate, such as
    one word repeated, is cut every max_tokens); the last chunk of a span takes what is left when less than
    min_tokens would remain. The expected chunk length is about `average_tokens`."""

    min_tokens: int = 32
    average_tokens: int = 64
    max_tokens: int = 256
    window: int = 8

    def __post_init__(self) -> None:
        if not (0 < self.window <= self.min_tokens < self.average_tokens and 2 * self.min_tokens <= self.max_tokens):
            raise ValueError(f"need 0 < window <= min < average and 2 * min <= max, got {self}")

    @classmethod
    def around(cls, average_tokens: int, min_tokens: int) -> "ContentDefinedCuts":
        """Cuts of about `average_tokens`, never shorter than `min_tokens` (the chunk index's minimum)."""
        low = max(min_tokens, average_tokens // 2)
        return cls(min_tokens=low, average_tokens=max(average_tokens, low + 1),
                   max_tokens=max(4 * average_tokens, 2 * low), window=min(8, low))

    def cut(self, tokens: Sequence[int], spans: Sequence[Span]) -> list[Span]:
        out: list[Span] = []
        for start, n in spans:
            out.extend((start + s, m) for s, m in self.pieces(tokens[start:start + n]))
        return out

    def candidates(self, tokens: Sequence[int]) -> list[bool]:
        """candidates[e]: a chunk may end right before token e (the window tokens before e hash to 0)."""
        raw = memoryview(array("q", tokens)).cast("B")
        w, div, width = self.window, self.average_tokens - self.min_tokens, 8  # bytes a token in raw
        flags = [False] * (len(tokens) + 1)
        for end in range(w, len(tokens) + 1):
            flags[end] = xxhash.xxh3_64_intdigest(raw[(end - w) * width:end * width]) % div == 0
        return flags

    def pieces(self, tokens: Sequence[int]) -> list[Span]:
        """(offset, length) of each chunk of one span."""
        n, low, high = len(tokens), self.min_tokens, self.max_tokens
        if n < 2 * low:
            return [(0, n)] if n else []
        flags = self.candidates(tokens)
        out, start = [], 0
        while n - start >= 2 * low:
            end = next((e for e in range(start + low, min(start + high, n - low) + 1) if flags[e]), None)
            if end is None:
                if n - start <= high:
                    break  # no cut needed: the rest is one chunk
                end = min(start + high, n - low)
            out.append((start, end - start))
            start = end
        out.append((start, n - start))
        return out


@dataclass(frozen=True)
class ParagraphCuts:
    """Cut each span at its blank lines first, then each paragraph by `inner`. A blank line is a run of
    whitespace-only tokens holding two or more line breaks (byte-level BPE tokenizes "\\n\\n" before a word as
    two "\\n" tokens, so a run, not one token); the run is a piece of its own, too short to be filed. A RAG
    pipeline that glues its passages with blank lines then gets chunks that end where its passages end, and a
    passage cuts the same way glued in any order, glued alone, or sent as a text part: content-defined cuts
    alone lose the chunks that straddled two passages in the earlier order (a third of a reordered glued
    prompt, benchmarks/bench_glued_cuts.py). `newlines`: each whitespace-only token id and the line breaks in
    it (blend.chunking.whitespace_tokens)."""

    inner: SpanCuts
    newlines: Mapping[int, int]

    def cut(self, tokens: Sequence[int], spans: Sequence[Span]) -> list[Span]:
        return self.inner.cut(tokens, self.paragraphs(tokens, spans))

    def paragraphs(self, tokens: Sequence[int], spans: Sequence[Span]) -> list[Span]:
        """`spans` split into paragraphs and the blank lines between them, in prompt order."""
        out: list[Span] = []
        for start, n in spans:
            piece = i = start  # piece: where the current paragraph began
            end = start + n
            while i < end:
                if tokens[i] not in self.newlines:
                    i += 1
                    continue
                run, lines = i, 0
                while i < end and tokens[i] in self.newlines:
                    lines += self.newlines[tokens[i]]
                    i += 1
                if lines >= 2:
                    out.extend(p for p in ((piece, run - piece), (run, i - run)) if p[1])
                    piece = i
            if piece < end:
                out.append((piece, end - piece))
        return out
