"""Selection strategies inside the engine: EPIC recomputes each chunk's first tokens and nothing else, A³
recomputes what the question attends to, CacheBlend what deviates; all spend the same budget."""
from __future__ import annotations

import pytest
import torch

from blend.selection import count_for_ratio
from blend.strategies import ChunkStarts, Deviation, QuestionAttention
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

from test_engine_blend import BS, build_prompt, checkpoint, drain, generate, make_engine, passages, precompute  # noqa: F401

HEAD = [5, 6, 7]
SEED = 0  # the passages' token ids (fixed, so a failure reproduces)


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = make_engine(checkpoint)
    for i, p in enumerate(passages(SEED, engine.vocab_size)):
        assert precompute(engine, p, f"pre{i}") == len(p)
    return engine


def prompt(engine, question):
    parts = passages(SEED, engine.vocab_size)
    return build_prompt([parts[2], parts[0], parts[1]], head=HEAD, question=question)


def blend(engine, rid, ids, spans, selection, ratio, prefix_cache=False):
    """One blended request; by default without the exact prefix cache, so that what earlier tests filed
    cannot serve part of a chunk and move where its reuse starts."""
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0),
                       CacheOptions(chunk_spans=spans, blend=True, recompute_ratio=ratio, blend_selection=selection,
                                    prefix_cache=prefix_cache))
    return drain(engine)[rid][2]


def prefilled_kv(engine, rid, ids, spans, selection, ratio, positions, layer):
    """K, V at `layer` of the given prompt positions right after a blended prefill (before anything rewrites
    them), and what the request reported."""
    engine.add_request(rid, ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       CacheOptions(chunk_spans=spans, blend=True, recompute_ratio=ratio, blend_selection=selection,
                                    prefix_cache=False))
    seq = engine.seqs[rid]
    while seq.num_computed < len(ids):
        engine.step()
    slots = torch.tensor([seq.block_table[p // BS] * BS + p % BS for p in positions])
    k, v = (t.float().clone() for t in engine.pool.read(layer, slots))
    engine.abort(rid)
    drain(engine)
    return k, v


def first_tokens(spans, counts):
    return [p for (start, _), k in zip(spans, counts) for p in range(start, start + k)]


def test_epic_recomputes_exactly_each_chunks_first_n_tokens(engine):
    ids, spans = prompt(engine, [9, 10, 11])
    out = blend(engine, "epic-k3", ids, spans, ChunkStarts(first_tokens=3), ratio=0.15)
    assert list(out.recomputed_positions) == first_tokens(spans, [3, 3, 3])
    assert out.recomputed_tokens == 9 and out.blended_tokens == sum(n for _, n in spans) - 9


def test_epic_spends_the_ratios_budget_over_the_chunks(engine):
    ids, spans = prompt(engine, [9, 10, 11])
    reused = sum(n for _, n in spans)  # 42 tokens in three chunks
    out = blend(engine, "epic-r", ids, spans, ChunkStarts(), ratio=0.3)
    budget = count_for_ratio(0.3, reused)  # 13: 5 + 4 + 4
    assert list(out.recomputed_positions) == first_tokens(spans, [5, 4, 4]) and out.recomputed_tokens == budget


@pytest.mark.parametrize("selection", [ChunkStarts(), QuestionAttention()], ids=["epic", "a3"])
def test_a_static_selection_computes_no_other_reused_token_at_any_layer(engine, selection):
    """EPIC and A³ choose before the forward: the reused tokens they leave keep their reused KV at every
    layer, as with no recompute at all; CacheBlend computes them up to its check layer to choose."""
    ids, spans = prompt(engine, [9, 10, 11])
    reused = [p for start, n in spans for p in range(start, start + n)]
    chosen = blend(engine, f"{selection.name}-pick", ids, spans, selection, 0.3).recomputed_positions
    left = [p for p in reused if p not in chosen]
    for layer in (1, engine.pool.num_layers - 1):
        stale = prefilled_kv(engine, f"none-{layer}", ids, spans, Deviation(), 0.0, left, layer)
        got = prefilled_kv(engine, f"{selection.name}-{layer}", ids, spans, selection, 0.3, left, layer)
        assert all(torch.equal(a, b) for a, b in zip(got, stale))
    # the control: CacheBlend's check layer wrote fresh KV over the tokens it then left
    cacheblend = prefilled_kv(engine, "cb-1", ids, spans, Deviation(), 0.3, left, 1)
    stale = prefilled_kv(engine, "none-1b", ids, spans, Deviation(), 0.0, left, 1)
    assert not torch.equal(cacheblend[0], stale[0])


def test_a3_chooses_by_the_question(engine):
    """Two questions over the same passages: A³ recomputes different tokens for each (the same number),
    while CacheBlend, whose deviation at layer 1 the question after the passages cannot change, picks the
    same ones for both."""
    picks = {}
    for name, question in (("q1", [9, 10, 11]), ("q2", [40, 41, 42, 43, 44])):
        ids, spans = prompt(engine, question)
        budget = count_for_ratio(0.3, sum(n for _, n in spans))
        a3 = blend(engine, f"a3-{name}", ids, spans, QuestionAttention(), 0.3)
        cb = blend(engine, f"cb-{name}", ids, spans, Deviation(), 0.3)
        assert a3.recomputed_tokens == cb.recomputed_tokens == budget
        picks[name] = (a3.recomputed_positions, cb.recomputed_positions)
    print("A³ picks:", picks["q1"][0], picks["q2"][0])
    assert picks["q1"][0] != picks["q2"][0]
    assert picks["q1"][1] == picks["q2"][1]


@pytest.mark.parametrize("selection", [ChunkStarts(), QuestionAttention()], ids=["epic", "a3"])
def test_a_static_selection_at_ratio_one_is_a_full_prefill(checkpoint, selection):
    blended = make_engine(checkpoint)
    full = make_engine(checkpoint, enable_blend=False)
    for i, p in enumerate(passages(SEED, blended.vocab_size)):
        precompute(blended, p, f"pre{i}")
    ids, spans = prompt(blended, [9, 10, 11])
    blended.add_request("b", ids, SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True),
                        CacheOptions(chunk_spans=spans, blend=True, recompute_ratio=1.0, blend_selection=selection))
    got = drain(blended)["b"]
    ref = generate(full, "f", ids, spans, blend=False)
    assert got[2].blended_tokens == 0 and got[2].recomputed_tokens == sum(n for _, n in spans)
    assert got[0] == ref[0]
    for x, y in zip(got[1], ref[1]):
        assert abs(x.logprob - y.logprob) <= 1e-4


def test_blended_kv_is_filed_by_selection(engine):
    """KV blended by one strategy never serves a request blending by another."""
    ids, spans = prompt(engine, [9, 10, 11, 12])
    blend(engine, "file-epic", ids, spans, ChunkStarts(), 0.3, prefix_cache=True)
    again = blend(engine, "again-epic", ids, spans, ChunkStarts(), 0.3, prefix_cache=True)
    other = blend(engine, "other-a3", ids, spans, QuestionAttention(), 0.3, prefix_cache=True)
    assert again.cached_tokens > other.cached_tokens
