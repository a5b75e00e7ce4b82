"""Blending text the client never marked: passages glued into one span (one message) are found by their
content wherever they stand (blend/content_cuts.py, ChunkIndex.starts) and blended like text parts.
Tiny random checkpoint with 4 layers, so the check layer is not the last and blending is approximate."""
from __future__ import annotations

import math
import random

import pytest

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from tiny_checkpoint import write_tiny_checkpoint
from test_engine_blend import close, drain

BS = 4
MIN = 8
CHUNK = 16  # chunks of about 16 tokens (8 to 64), so passages of ~60 tokens are cut several times


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-glued"), arch="llama", num_layers=4, seed=5)


def make_engine(path, **kw):
    # the fidelity check off unless a test turns it on: a random checkpoint's deviations say nothing of its text
    cfg = dict(model=str(path), block_size=BS, num_gpu_blocks=1024, max_num_seqs=4, max_num_batched_tokens=128,
               enable_blend=True, blend_min_tokens=MIN, blend_chunk_tokens=CHUNK, blend_max_deviation=math.inf)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg))


def words(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def glued(head: list[int], passages: list[list[int]], question: list[int]):
    """One prompt with all passages in ONE span (a single message), as a RAG pipeline glues them."""
    body = [t for p in passages for t in p] + question
    return head + body, [(len(head), len(body))]


def run(engine, rid, ids, spans, blend=True, ratio=None, max_tokens=4):
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True),
                       CacheOptions(chunk_spans=spans, blend=blend, recompute_ratio=ratio))
    out = drain(engine)[rid]
    assert engine.cache.stats().in_use_blocks == 0  # nothing held once it is done
    return out


@pytest.fixture
def rng():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return random.Random(seed)


def rejected(engine) -> tuple[int, int]:
    """(chunks, tokens) the fidelity check rejected so far."""
    snap = engine.snapshot()
    return snap["blend_rejected_chunks"], snap["blend_rejected_tokens"]


# the fidelity check off, at the threshold calibrated for this checkpoint (None: auto), and rejecting everything
CHECKS = [math.inf, None, 0.0]


@pytest.mark.parametrize("max_deviation", CHECKS, ids=["check-off", "check-auto", "check-rejects-all"])
def test_a_reordered_glued_prompt_blends_most_of_itself(checkpoint, rng, max_deviation):
    engine = make_engine(checkpoint, blend_max_deviation=max_deviation)
    full = make_engine(checkpoint, enable_blend=False)
    passages = [words(rng, engine.vocab_size, rng.randrange(50, 70)) for _ in range(4)]
    head, question = [5, 6, 7], words(rng, engine.vocab_size, 5)
    first_ids, first_spans = glued(head, passages, question)
    run(engine, "first", first_ids, first_spans)  # files its pieces; nothing to blend yet
    order = [passages[i] for i in (2, 0, 3, 1)]
    ids, spans = glued(head, order, question)
    out = run(engine, "reordered", ids, spans)
    found = out[2].blended_tokens + out[2].recomputed_tokens
    assert found > len(ids) / 2, (found, len(ids))
    chunks, tokens = rejected(engine)
    # a rejected chunk is recomputed, never counted as blended
    assert out[2].recomputed_tokens >= tokens and out[2].blended_tokens <= found - tokens
    if max_deviation == 0.0:  # every chunk found is rejected: the answer is a full prefill's
        assert out[2].blended_tokens == 0 and tokens == found and chunks > 0
        ref = run(full, "full0", ids, spans, blend=False)
        assert out[0] == ref[0]
        close(out[1], ref[1], 1e-4)
    else:
        assert out[2].blended_tokens > len(ids) / 4, (out[2].blended_tokens, len(ids))
    if max_deviation == math.inf:
        assert (chunks, tokens) == (0, 0)
    # everything found is recomputed at ratio 1: the answer is a full prefill's
    exact = run(engine, "exact", ids, spans, ratio=1.0)
    ref = run(full, "full", ids, spans, blend=False)
    if max_deviation == 0.0:  # nothing was blended: the prompt's KV was exact and filed as such, and hits now
        assert exact[2].cached_tokens >= len(ids) - BS and exact[2].blended_tokens == 0
    else:
        assert exact[2].recomputed_tokens > len(ids) / 2 and exact[2].blended_tokens == 0
    assert exact[0] == ref[0]
    close(exact[1], ref[1], 1e-4)


def test_passages_glued_with_blank_lines_are_found_whole_in_any_order(checkpoint, rng):
    """A RAG pipeline's blank lines between passages are cuts (ParagraphCuts): after one prompt files the
    passages in one order, another order finds every token of every passage, where content cuts alone lose
    the chunks that straddled two passages."""
    engine = make_engine(checkpoint)
    blank = list(engine.tokenizer.encode("\n\n", add_special_tokens=False))
    plain = [t for t in range(3, engine.vocab_size) if engine.tokenizer.decode([t]).strip()]  # no whitespace
    passages = [[rng.choice(plain) for _ in range(rng.randrange(50, 70))] for _ in range(4)]

    def prompt(order):
        body = [t for p in order for t in p + blank]
        return [5, 6, 7] + body + [9, 10], [(3, len(body) + 2)]

    run(engine, "first", *prompt(passages))
    out = run(engine, "reordered", *prompt([passages[i] for i in (2, 0, 3, 1)]))[2]
    assert out.blended_tokens + out.recomputed_tokens >= sum(map(len, passages)), out


def test_without_content_cuts_a_reordered_glued_prompt_reuses_only_what_starts_a_filed_span(checkpoint, rng):
    """--blend-chunk-tokens 0: only the client's spans are filed; the glued message is one chunk, so only
    the passage that started it is found again (at its new offset), not the three filed inside it."""
    engine = make_engine(checkpoint, blend_chunk_tokens=0)
    passages = [words(rng, engine.vocab_size, 60) for _ in range(4)]
    head, question = [5, 6, 7], words(rng, engine.vocab_size, 5)
    run(engine, "first", *glued(head, passages, question))
    ids, spans = glued(head, [passages[i] for i in (2, 0, 3, 1)], question)
    out = run(engine, "reordered", ids, spans)[2]
    assert out.blended_tokens + out.recomputed_tokens <= len(passages[0])


def test_the_same_text_at_two_offsets_is_reused_at_both(checkpoint, rng):
    engine = make_engine(checkpoint)
    text = words(rng, engine.vocab_size, 80)
    engine.precompute("doc", text, CacheOptions(chunk_spans=[(0, len(text))]))
    assert drain(engine)["doc"][2].chunk_tokens_stored == len(text)
    a, b = words(rng, engine.vocab_size, 23), words(rng, engine.vocab_size, 31)
    body = a + text + b + text + [9, 10]
    out = run(engine, "twice", [5, 6, 7] + body, [(3, len(body))], ratio=1.0)[2]
    # one place alone could give at most len(text) reused tokens
    assert out.recomputed_tokens > 1.5 * len(text), out.recomputed_tokens


@pytest.mark.parametrize("max_deviation", CHECKS, ids=["check-off", "check-auto", "check-rejects-all"])
@pytest.mark.parametrize("pattern", [[17], [17, 18], [40, 41, 42, 43, 44, 45, 46]])
def test_repeated_words_blend_without_error_or_leaks(checkpoint, pattern, max_deviation):
    """'hi hi hi ...': every window hashes alike. The chunks are filed once, found at every offset, and a
    blend of them ends like any other (ratio 1: the same answer as a full prefill). What the fidelity check
    rejects is recomputed, not counted as blended."""
    engine = make_engine(checkpoint, blend_max_deviation=max_deviation)
    full = make_engine(checkpoint, enable_blend=False)
    text = (pattern * 200)[:300]
    run(engine, "first", *glued([5, 6, 7], [text], [9, 10]))
    engine.cache.check_invariants()
    ids, spans = glued([5, 6, 7, 8, 8], [text[:-3]], [9, 11])
    out = run(engine, "again", ids, spans)
    found = out[2].blended_tokens + out[2].recomputed_tokens
    assert found > len(text) / 2
    chunks, tokens = rejected(engine)
    assert out[2].recomputed_tokens >= tokens and out[2].blended_tokens <= found - tokens
    if max_deviation == 0.0:
        assert out[2].blended_tokens == 0 and tokens == found and chunks > 0
        ref0 = run(full, "full0", ids, spans, blend=False)
        assert out[0] == ref0[0]
        close(out[1], ref0[1], 1e-4)
    if max_deviation == math.inf:
        assert (chunks, tokens) == (0, 0)
    exact = run(engine, "exact", ids, spans, ratio=1.0)
    ref = run(full, "full", ids, spans, blend=False)
    assert exact[0] == ref[0]
    close(exact[1], ref[1], 1e-4)
    engine.cache.check_invariants()
