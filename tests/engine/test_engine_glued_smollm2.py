"""On the bundled SmolLM2: passages a RAG pipeline glues into one message with blank lines, the needle in one of
them, are filed by one request and found again in other orders. The reordered prompt blends most of itself and
answers as a full prefill of it does: the same greedy answer (the code in one order, nothing in the others, when
written), the first token's distribution close to full prefill's."""
from __future__ import annotations

import pytest

from benchmarks.bench_blend import CapturingSampler, kl
from blend.chunking import encode, render_chat_chunks
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.model.loader import resolve_model
from test_engine_key_shift import HELD_OUT, NEEDLE, QUESTION

TEXTS = HELD_OUT[:2] + [HELD_OUT[2].replace(". ", f". {NEEDLE} ", 1)] + HELD_OUT[3:]  # the needle in passage 2


@pytest.fixture(scope="module")
def engine():
    # the server's blending settings (fidelity check auto, key shift, content and blank-line cuts)
    engine = build_engine(EngineConfig(model=str(resolve_model(None)), kv_cache_memory=256 << 20,
                                       max_num_batched_tokens=2048))
    engine.sampler = CapturingSampler()
    return engine


def glued(engine, order: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    text = "\n\n".join([TEXTS[i] for i in order] + [QUESTION])
    ids, spans = [], []
    for c in render_chat_chunks(engine.tokenizer, [{"role": "user", "content": text}]):
        if c.reusable:
            spans.append((len(ids), len(c.tokens)))
        ids += c.tokens
    return ids + list(encode(engine.tokenizer, "Answer:")), spans


def answer(engine, rid: str, ids, spans, blend: bool):
    engine.add_request(rid, ids, SamplingParams(max_tokens=16, temperature=0.0),
                       CacheOptions(prefix_cache=blend, chunk_spans=spans, blend=blend))
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


@pytest.mark.parametrize("order", [[3, 0, 2, 1], [1, 3, 0, 2], [2, 1, 3, 0]])
def test_a_reordered_glued_rag_prompt_blends_and_answers_as_full_prefill(engine, order):
    answer(engine, "filed", *glued(engine, [0, 1, 2, 3]), blend=True)  # an earlier request files the pieces
    ids, spans = glued(engine, order)
    tag = "-".join(map(str, order))
    full, _ = answer(engine, f"full-{tag}", ids, spans, blend=False)
    blended, out = answer(engine, f"blend-{tag}", ids, spans, blend=True)
    assert out.blended_tokens > len(ids) / 2, (out.blended_tokens, len(ids))
    said = {name: engine.tokenizer.decode(ids) for name, ids in (("full", full), ("blended", blended))}
    assert blended == full, said
    first = kl(engine.sampler.first_logits[f"full-{tag}"], engine.sampler.first_logits[f"blend-{tag}"])
    print(f"order {order}: {out.blended_tokens} of {len(ids)} tokens blended, answers {said}, "
          f"first-token KL {first:.4f}")
    assert first < 0.1
