"""The fidelity check of blending (blend/fidelity.py): a reused chunk whose KV deviates from what the prompt
computes is rejected and recomputed whole, under every selection strategy, and counted as such; chunks that
deviate little keep blending. Tiny random checkpoint with 4 layers (check layer 1 is not the last)."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from blend.chunking import encode, render_chat_chunks
from reuse_server.api.cache_stats import cache_stats
from reuse_server.api.cache_viewer import WholeServer
from reuse_server.api.chat_template import user_turn_opening
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.engine.fidelity_calibration import MARGIN, load_or_calibrate_threshold
from reuse_server.model.loader import load_model, load_tokenizer, resolve_model
from reuse_server.server.metrics import COUNTERS
from test_engine_blend import close, drain
from test_engine_glued import checkpoint, glued, make_engine, run, words  # noqa: F401 (fixture)
from test_engine_key_shift import HELD_OUT, QUESTION

BS = 4


@pytest.fixture
def rng():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return random.Random(seed)


def file_chunk(engine, rid: str, chunk: list[int]) -> None:
    engine.precompute(rid, chunk, CacheOptions(chunk_spans=[(0, len(chunk))]))
    assert drain(engine)[rid][2].chunk_tokens_stored == len(chunk)


def overwrite_with_noise(engine, chunk: list[int], rng: random.Random) -> None:
    """Replace the filed chunk's K/V in every layer by noise of three times its scale, through the pool's own
    read and write (as a damaged tier copy or a wrong chunk would hold)."""
    hit = engine.chunk_index.lookup(chunk)
    assert hit is not None and hit.num_tokens == len(chunk)
    slots = torch.tensor([hit.block_ids[p // BS] * BS + p % BS for p in range(len(chunk))])
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for layer in range(engine.pool.num_layers):
        k, v = engine.pool.read(layer, slots)
        noise_k = torch.randn(k.shape, generator=gen) * 3 * k.float().std()
        noise_v = torch.randn(v.shape, generator=gen) * 3 * v.float().std()
        engine.pool.write(layer, slots, noise_k.to(k.dtype), noise_v.to(v.dtype))


def blend_counters(engine) -> tuple[int, int]:
    snap = engine.snapshot()
    return snap["blend_rejected_chunks"], snap["blend_rejected_tokens"]


@pytest.mark.parametrize("selection", ["cacheblend", "epic", "a3"])
def test_a_chunk_whose_kv_is_noise_is_rejected_and_the_answer_is_a_full_prefills(checkpoint, rng, selection):
    """Ratio 0 reuses every token found; with the chunk's KV turned to noise the check, at the threshold
    calibrated for this checkpoint (auto), rejects it, so every token is computed and the answer (tokens and
    log-probs) is the full prefill's."""
    engine = make_engine(checkpoint, blend_selection=selection, blend_max_deviation=None)
    full = make_engine(checkpoint, enable_blend=False)
    chunk = words(rng, engine.vocab_size, 40)
    file_chunk(engine, "doc", chunk)
    overwrite_with_noise(engine, chunk, rng)
    head, question = [5, 6, 7] + words(rng, engine.vocab_size, 9), words(rng, engine.vocab_size, 5)
    ids, spans = glued(head, [chunk], question)
    out = run(engine, "q", ids, spans, ratio=0.0)
    ref = run(full, "full", ids, spans, blend=False)
    assert blend_counters(engine) == (1, len(chunk))
    last = out[2]
    assert last.blended_tokens == 0 and last.recomputed_tokens == len(chunk), (last.blended_tokens,
                                                                              last.recomputed_tokens)
    assert out[0] == ref[0]
    close(out[1], ref[1], 1e-4)
    # the Prometheus counters read the same snapshot keys
    assert {"blend_rejected_chunks", "blend_rejected_tokens"} <= set(COUNTERS)


def test_with_the_check_off_the_noise_is_blended(checkpoint, rng):
    """The control of the test above: inf turns the check off, and the noise is reused (the answer departs
    from a full prefill's), so the test above passes because of the check."""
    engine = make_engine(checkpoint, blend_max_deviation=math.inf)
    full = make_engine(checkpoint, enable_blend=False)
    chunk = words(rng, engine.vocab_size, 40)
    file_chunk(engine, "doc", chunk)
    overwrite_with_noise(engine, chunk, rng)
    ids, spans = glued([5, 6, 7] + words(rng, engine.vocab_size, 9), [chunk], words(rng, engine.vocab_size, 5))
    out = run(engine, "q", ids, spans, ratio=0.0)
    ref = run(full, "full", ids, spans, blend=False)
    assert blend_counters(engine) == (0, 0) and out[2].blended_tokens == len(chunk)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(out[1], ref[1])) > 1e-3


def test_only_the_bad_chunk_is_rejected_and_its_tokens_come_on_top_of_the_budget(checkpoint, rng):
    """Two chunks found, one of them noise: that one is recomputed whole, the other is blended with the
    selection's budget (ceil(ratio * reused tokens)) spent among all reused tokens as before."""
    engine = make_engine(checkpoint, blend_max_deviation=1.0)
    good, bad = words(rng, engine.vocab_size, 40), words(rng, engine.vocab_size, 44)
    file_chunk(engine, "good", good)
    file_chunk(engine, "bad", bad)
    overwrite_with_noise(engine, bad, rng)
    ids, spans = glued([5, 6, 7], [good, bad], words(rng, engine.vocab_size, 5))
    ratio = 0.25
    last = run(engine, "q", ids, spans, ratio=ratio)[2]
    assert blend_counters(engine) == (1, len(bad))
    reused = len(good) + len(bad)  # the first chunk starts inside the head's block: no prefix hit
    assert last.blended_tokens + last.recomputed_tokens == reused
    budget = math.ceil(ratio * reused)
    assert last.recomputed_tokens == len(bad) + min(budget, len(good)), (last.recomputed_tokens, budget)
    bad_at = ids.index(bad[0], 3 + len(good))
    assert set(range(bad_at, bad_at + len(bad))) <= set(last.recomputed_positions)


def test_the_stats_report_the_rejections(checkpoint, rng):
    engine = make_engine(checkpoint, blend_max_deviation=1.0)
    chunk = words(rng, engine.vocab_size, 40)
    file_chunk(engine, "doc", chunk)
    overwrite_with_noise(engine, chunk, rng)
    run(engine, "q", *glued([5, 6, 7, 8], [chunk], [9, 10]), ratio=0.0)
    blend = json.loads(cache_stats(engine, WholeServer()))["blend"]
    assert blend["rejected_chunks"] == 1 and blend["rejected_tokens"] == len(chunk)
    assert blend["max_deviation"] == 1.0 and blend["blended_tokens"] == 0


# --- the bundled SmolLM2, at its calibrated threshold ---------------------------------------------------------

def chat(tok, texts: list[str]):
    """A user message of text parts, as a RAG client sends passages: (ids, spans of the parts)."""
    chunks = render_chat_chunks(tok, [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}])
    ids, spans = [], []
    for c in chunks:
        if c.reusable:
            spans.append((len(ids), len(c.tokens)))
        ids += c.tokens
    return ids, spans


def test_on_smollm2_reordered_passages_blend_and_a_passage_filed_after_another_prefix_is_rejected():
    """Real passages filed alone and served in a new order deviate little and keep blending; a passage whose
    KV was computed after a run of one repeated word (filed in that context) deviates far more where it now
    follows a real passage, and is rejected. The threshold is the one calibrated for the model (auto)."""
    engine = build_engine(EngineConfig(model=str(resolve_model(None)), kv_cache_memory=256 << 20,
                                       max_num_batched_tokens=2048, blend_min_tokens=16))
    threshold = engine.blender.settings.fidelity.max_deviation
    print(f"calibrated threshold {threshold}")
    assert 0 < threshold < math.inf
    tok = engine.tokenizer
    opening = user_turn_opening(tok)
    for i, text in enumerate(HELD_OUT[:3]):  # filed alone after the opening, as POST /v1/cache/chunks does
        t = list(encode(tok, text))
        engine.precompute(f"pre{i}", opening + t, CacheOptions(chunk_spans=[(len(opening), len(t))]))
    drain(engine)
    ids, spans = chat(tok, [" ".join(["zero"] * 120), HELD_OUT[3]])
    engine.add_request("context", ids, SamplingParams(max_tokens=1),
                       CacheOptions(chunk_spans=spans, blend=True, prefix_cache=False))
    drain(engine)
    assert blend_counters(engine) == (0, 0)
    ids, spans = chat(tok, [HELD_OUT[i] for i in (2, 0, 3, 1)] + [QUESTION])
    engine.add_request("reordered", ids, SamplingParams(max_tokens=1, temperature=0.0),
                       CacheOptions(chunk_spans=spans, blend=True, prefix_cache=False))
    out = drain(engine)["reordered"][2]
    filed_alone = sum(len(encode(tok, HELD_OUT[i])) for i in range(3))
    after_zeros = len(encode(tok, HELD_OUT[3]))
    assert blend_counters(engine) == (1, after_zeros)
    assert out.blended_tokens + out.recomputed_tokens == filed_alone + after_zeros
    assert out.blended_tokens >= 0.8 * filed_alone, (out.blended_tokens, filed_alone)


def test_the_threshold_is_calibrated_once_per_model_and_reloaded(tmp_path, checkpoint):
    model, _ = load_model(checkpoint)
    tok = load_tokenizer(checkpoint)
    first = load_or_calibrate_threshold(model, tok, checkpoint, torch.float32, "cpu", 1, None, cache_dir=tmp_path)
    [kept] = list(tmp_path.glob("*-fidelity-*.json"))
    devs = json.loads(kept.read_text())["deviations"]
    assert first == MARGIN * max(devs) and all(0 < d < math.inf for d in devs)
    stamp = kept.stat().st_mtime_ns
    again = load_or_calibrate_threshold(model, tok, checkpoint, torch.float32, "cpu", 1, None, cache_dir=tmp_path)
    assert again == first
    assert kept.stat().st_mtime_ns == stamp
    # another check layer is another calibration
    load_or_calibrate_threshold(model, tok, checkpoint, torch.float32, "cpu", 2, None, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*-fidelity-*.json"))) == 2
