"""Content-defined cuts: the chunks a span is cut into depend on its tokens, never on where it stands.

Property tests (hypothesis prints the failing example and its reproduction blob) and seeded random trials
(each prints its seed)."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blend.content_cuts import ContentDefinedCuts, ParagraphCuts, WholeSpans

CUTS = ContentDefinedCuts(min_tokens=8, average_tokens=12, max_tokens=32, window=4)
# a small vocabulary, so windows repeat and cut candidates are found at many places
TOKENS = st.lists(st.integers(0, 40), max_size=300)
SETTINGS = settings(max_examples=200, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])


def ends(cuts: ContentDefinedCuts, tokens: list[int], offset: int = 0) -> list[int]:
    """Where the chunks of `tokens` end, relative to `offset`."""
    return [s + n - offset for s, n in cuts.pieces(tokens)]


@SETTINGS
@given(tokens=TOKENS)
def test_pieces_tile_the_span_within_the_bounds(tokens):
    pieces = CUTS.pieces(tokens)
    assert [s for s, _ in pieces] == ([0] + [s + n for s, n in pieces[:-1]] if tokens else [])
    assert sum(n for _, n in pieces) == len(tokens)
    if len(tokens) < 2 * CUTS.min_tokens:
        assert pieces == ([(0, len(tokens))] if tokens else [])
    else:
        assert all(CUTS.min_tokens <= n <= CUTS.max_tokens for _, n in pieces[:-1])
        assert CUTS.min_tokens <= pieces[-1][1] <= max(CUTS.max_tokens, 2 * CUTS.min_tokens - 1)


@SETTINGS
@given(head=TOKENS, other_head=TOKENS, text=TOKENS)
def test_the_same_text_cuts_the_same_way_at_any_offset(head, other_head, text):
    """Once two prompts that end with the same text cut it at one place, they cut it the same way from
    there to the end: a cut depends only on the tokens around it."""
    a = [e for e in ends(CUTS, head + text, len(head)) if e > 0]
    b = [e for e in ends(CUTS, other_head + text, len(other_head)) if e > 0]
    common = sorted(set(a) & set(b))
    if common:
        assert [e for e in a if e >= common[0]] == [e for e in b if e >= common[0]]


@SETTINGS
@given(head=TOKENS, text=TOKENS)
def test_text_after_a_cut_cuts_as_it_does_alone(head, text):
    """A chunk boundary right before the text: the text is cut exactly as when it is a span of its own."""
    whole = ends(CUTS, head + text, len(head))
    if 0 in whole:
        assert [e for e in whole if e > 0] == ends(CUTS, text)


def test_passages_at_other_offsets_share_most_of_their_cuts():
    """Random passages of a real vocabulary's size after random other text: the cuts inside each agree with
    the cuts of the passage alone after its first few dozen tokens."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    cuts = ContentDefinedCuts()  # the server's defaults
    shared = total = 0
    for _ in range(50):
        passage = [rng.randrange(3, 49152) for _ in range(rng.randrange(300, 800))]
        head = [rng.randrange(3, 49152) for _ in range(rng.randrange(0, 500))]
        alone = cuts.pieces(passage)
        glued = {(s - len(head), n) for s, n in cuts.pieces(head + passage)}
        shared += sum(n for piece in alone if piece in glued for n in [piece[1]])
        total += len(passage)
    assert shared / total > 0.7, f"seed {seed}: only {shared / total:.2f} of the passages cut alike"


@pytest.mark.parametrize("tokens", [[7] * 1000, [7, 8] * 500, list(range(50)) * 20])
def test_repeated_text_cuts_within_the_bounds(tokens):
    """One word or a phrase repeated: every window hashes alike, so either every place is a candidate or
    none is; chunks stay within the bounds, with no error."""
    cuts = ContentDefinedCuts()
    pieces = cuts.pieces(tokens)
    assert sum(n for _, n in pieces) == len(tokens)
    assert all(cuts.min_tokens <= n <= cuts.max_tokens for _, n in pieces)


def test_spans_are_cut_one_by_one_and_whole_spans_are_kept():
    rng = random.Random(0)
    tokens = [rng.randrange(3, 1000) for _ in range(900)]
    spans = [(0, 400), (400, 20), (420, 480)]
    cut = CUTS.cut(tokens, spans)
    for start, n in spans:  # no chunk crosses a span's edge: messages and parts stay boundaries
        inside = [(s, m) for s, m in cut if start <= s < start + n]
        assert inside and inside[0][0] == start and sum(m for _, m in inside) == n
    assert WholeSpans().cut(tokens, spans) == spans


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        ContentDefinedCuts(min_tokens=16, average_tokens=16)
    with pytest.raises(ValueError):
        ContentDefinedCuts(min_tokens=32, average_tokens=64, max_tokens=40)
    around = ContentDefinedCuts.around(64, 100)  # never shorter than the chunk index's minimum
    assert around.min_tokens == 100 and around.average_tokens > 100 and around.max_tokens >= 200


# whitespace-only tokens of a toy vocabulary and their line breaks: 0 "\\n", 1 " ", 2 "\\n\\n", 3 "\\n  "
NEWLINES = {0: 1, 1: 0, 2: 2, 3: 1}
PARAGRAPHS = ParagraphCuts(CUTS, NEWLINES)
WORDS = st.lists(st.integers(4, 40), min_size=1, max_size=120)  # text with no whitespace token
BLANK_LINES = st.sampled_from([[0, 0], [2], [0, 1, 0], [3, 3], [0, 2, 1]])


@SETTINGS
@given(passages=st.lists(WORDS, min_size=1, max_size=5), breaks=st.lists(BLANK_LINES, min_size=5, max_size=5),
       head=st.lists(st.integers(0, 40), max_size=30))
def test_a_passage_between_blank_lines_cuts_as_it_does_alone(passages, breaks, head):
    """Passages glued with blank lines, in any order, after any head: each is cut into exactly the chunks it
    is cut into alone, and each blank line is a piece of its own."""
    tokens, where = list(head), []
    for passage, blank in zip(passages, breaks):
        tokens += blank
        where.append((len(tokens), passage))
        tokens += passage
    pieces = PARAGRAPHS.cut(tokens, [(0, len(tokens))])
    assert [s for s, _ in pieces] == [0] + [s + n for s, n in pieces[:-1]] and sum(n for _, n in pieces) == len(tokens)
    for start, passage in where:
        inside = [(s - start, n) for s, n in pieces if start <= s < start + len(passage)]
        assert inside == CUTS.pieces(passage)
    for (start, passage), blank in zip(where, breaks):
        # (the first blank line may take in whitespace the head ends with)
        assert (start - len(blank), len(blank)) in pieces or start - len(blank) <= len(head)


def test_one_line_break_is_not_a_paragraph():
    text = list(range(4, 24)) + [0, 1] + list(range(24, 44))  # "\\n " then more text: one line break
    assert PARAGRAPHS.paragraphs(text, [(0, len(text))]) == [(0, len(text))]
    text = list(range(4, 24)) + [3, 0] + list(range(24, 44))  # "\\n  \\n": a blank line
    assert PARAGRAPHS.paragraphs(text, [(0, len(text))]) == [(0, 20), (20, 2), (22, 20)]
    # a blank line at a span's edges, and spans kept apart
    assert PARAGRAPHS.paragraphs([2, 5, 6, 2, 7, 0, 0], [(0, 3), (3, 4)]) == [(0, 1), (1, 2), (3, 1), (4, 1), (5, 2)]
