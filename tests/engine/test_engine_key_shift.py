"""The key shift inside the engine: calibrated once per model and kept on disk, added only to chunks reused
from their alone form, and on the bundled SmolLM2 it brings blended answers closer to full prefill."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from benchmarks.bench_blend import CapturingSampler, kl
from blend.chunking import encode, render_chat_chunks
from blend.key_shift import unrope
from reuse_server.api.chat_template import user_turn_opening
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.key_shift_calibration import calibration_chats, load_or_calibrate
from reuse_server.model.loader import load_model, load_tokenizer, resolve_model
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from test_engine_blend import BS, build_prompt, generate, make_engine, passages
from tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def test_calibration_chats_open_like_a_precomputed_document(checkpoint):
    """The shift is measured against chunks computed after the same opening POST /v1/cache/chunks uses."""
    tok = load_tokenizer(checkpoint)
    opening, chats = calibration_chats(tok)
    assert opening and opening == user_turn_opening(tok)
    firsts = [tuple(chat[0]) for chat in chats]
    later = {tuple(p) for chat in chats for p in chat[1:]}
    assert len(set(firsts)) == len(firsts) and set(firsts) <= later  # each comes first once, after others elsewhere


def test_the_shift_is_calibrated_once_and_reloaded(tmp_path, checkpoint):
    model, _ = load_model(checkpoint)
    tok = load_tokenizer(checkpoint)
    first = load_or_calibrate(model, tok, checkpoint, torch.float32, "cpu", cache_dir=tmp_path)
    [kept] = list(tmp_path.glob("*.safetensors"))
    stamp = kept.stat().st_mtime_ns
    assert first.k.shape == (model.config.num_layers, model.config.num_kv_heads, model.config.head_dim)
    assert first.k[1:].abs().sum() > 0  # layers after the first see the context
    again = load_or_calibrate(model, tok, checkpoint, torch.float32, "cpu", cache_dir=tmp_path)
    assert torch.equal(again.k, first.k) and kept.stat().st_mtime_ns == stamp
    kept.write_bytes(b"not a safetensors file")
    repaired = load_or_calibrate(model, tok, checkpoint, torch.float32, "cpu", cache_dir=tmp_path)
    assert torch.allclose(repaired.k, first.k, atol=1e-6)
    # another dtype is another file
    load_or_calibrate(model, tok, checkpoint, torch.bfloat16, "cpu", cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def copied_keys(engine: LLMEngine, ids, spans) -> list[torch.Tensor]:
    """Every layer's keys of the prompt's positions right after the chunk index copied its chunks in."""
    engine.add_request("probe", ids, SamplingParams(max_tokens=1), CacheOptions(chunk_spans=spans, blend=True))
    seq = engine.seqs["probe"]
    engine.blocks.admit(seq, len(ids))
    assert engine.blender.open_job(seq) and engine.blender.blending(seq)  # chunks found and copied in
    slots = torch.tensor([seq.block_table[p // BS] * BS + p % BS for p in range(len(ids))])
    keys = engine.pool.read_keys(slots)
    engine.abort("probe")
    assert engine.cache.stats().in_use_blocks == 0
    return keys


def test_the_shift_goes_to_chunks_reused_alone_after_other_text_only(checkpoint):
    on, off = make_engine(checkpoint), make_engine(checkpoint, blend_key_shift=False)
    first, second = passages(11, on.vocab_size, sizes=(14, 17))
    ids, spans = build_prompt([first, second], head=[3, 4], question=[5])
    for engine in (on, off):  # ordinary traffic: the first chunk is filed alone, the second in context
        generate(engine, "a", ids, spans, blend=True)
        assert engine.chunk_index.lookup(first).alone and not engine.chunk_index.lookup(second).alone
    ids, spans = build_prompt([second, first], head=[6], question=[5])
    k_on, k_off = copied_keys(on, ids, spans), copied_keys(off, ids, spans)
    (s_second, n_second), (s_first, n_first) = spans
    inv_freq = on.model.rotary.inv_freq
    for layer in range(on.pool.num_layers):
        assert torch.equal(k_on[layer][s_second:s_second + n_second], k_off[layer][s_second:s_second + n_second])
        moved = slice(s_first, s_first + n_first)
        pos = torch.arange(s_first, s_first + n_first)
        delta = unrope(k_on[layer][moved], pos, inv_freq) - unrope(k_off[layer][moved], pos, inv_freq)
        assert torch.allclose(delta, on.blender.key_shift.k[layer].expand_as(delta), atol=1e-5)
    # reused as the prompt's first chunk again, an alone chunk is where it was computed: no shift
    ids, spans = build_prompt([first, second], head=[7], question=[5])
    k_on, k_off = copied_keys(on, ids, spans), copied_keys(off, ids, spans)
    for layer in range(on.pool.num_layers):
        assert torch.equal(k_on[layer], k_off[layer])


# --- the bundled SmolLM2 ------------------------------------------------------------------------------------

HELD_OUT = [  # not calibration text: written for this test
    "The lighthouse keeper kept a logbook for forty years. Each night he wrote down the wind speed, the state of "
    "the sea and the names of the ships that passed the point, and in winter he added notes about the birds that "
    "sheltered on the gallery rail during storms. When the light was automated the logbooks went to the county "
    "archive, where a historian later used them to show how the fishing fleet shrank after the canning factory "
    "closed and how the number of winter storms rose in the last decade he kept watch.",
    "Copper wire carries electricity well because the outer electrons of its atoms move freely through the metal. "
    "Engineers choose thicker wire for long runs, since resistance grows with length and the lost energy turns "
    "into heat that can slowly damage the insulation. Aluminium is lighter and cheaper, so it is used for overhead "
    "power lines, but it expands more with heat and needs special connectors, and it was blamed for house fires "
    "when it was first used for indoor wiring in the nineteen sixties.",
    "The village market opens at dawn every Saturday. Farmers bring eggs, cheese and vegetables down from the "
    "valley, a baker sells rye loaves from a wooden cart, and an old man repairs umbrellas under the arcade of "
    "the town hall. By noon the stalls are packed away and the square is swept clean. The council once tried to "
    "move the market to a car park on the edge of town, but so few people followed it that the traders returned "
    "to the square within a month.",
    "In the final chapter the detective returns to the empty house on the hill, finds the letter hidden behind the "
    "kitchen clock, and realises that the gardener had been telling the truth from the very beginning. The letter, "
    "written by the owner a week before she vanished, explains that she had sold the paintings herself to pay a "
    "debt and had left the country under her sister's name. The novel ends with the detective burning the letter, "
    "deciding that some secrets are better kept.",
]
NEEDLE = "The access code for the Orion project is 4812."
QUESTION = "What is the access code for the Orion project?"


def first_token_kls(engine: LLMEngine, ratio: float) -> list[float]:
    tok = engine.tokenizer
    engine.sampler = sampler = CapturingSampler()
    opening = user_turn_opening(tok)
    texts = HELD_OUT[:2] + [HELD_OUT[2].replace(". ", f". {NEEDLE} ", 1)] + HELD_OUT[3:]  # a needle in passage 2
    for i, text in enumerate(texts):  # precomputed alone after the opening, as POST /v1/cache/chunks does
        t = list(encode(tok, text))
        engine.precompute(f"pre{i}", opening + t, CacheOptions(chunk_spans=[(len(opening), len(t))]))
    while engine.has_work():
        engine.step()
    kls = []
    for order in ([3, 0, 2, 1], [1, 3, 0, 2], [2, 1, 3, 0]):
        parts = [{"type": "text", "text": texts[i]} for i in order] + [{"type": "text", "text": QUESTION}]
        chunks = render_chat_chunks(tok, [{"role": "user", "content": parts}])
        ids, spans, pos = [], [], 0
        for c in chunks:
            if c.reusable:
                spans.append((pos, len(c.tokens)))
            ids += c.tokens
            pos += len(c.tokens)
        ids += encode(tok, "Answer:")  # the assistant turn starts the answer, so its first token is the code
        tag = "-".join(map(str, order))
        for rid, blend in ((f"full-{tag}", False), (f"blend-{tag}", True)):
            engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0),
                               CacheOptions(prefix_cache=False, chunk_spans=spans, blend=blend, recompute_ratio=ratio))
            while engine.has_work():
                engine.step()
        kls.append(kl(sampler.first_logits[f"full-{tag}"], sampler.first_logits[f"blend-{tag}"]))
    return kls


@pytest.fixture(scope="module")
def smollm2_engines():
    # room for every passage whole and in content-cut pieces (the Blender files both), so no passage's whole
    # chunk is evicted before its reuse and each is reused whole, its key shift reaching all of it
    # the fidelity check off: the shift's effect is measured alone
    cfg = dict(model=str(resolve_model(None)), kv_cache_memory=256 << 20, max_num_batched_tokens=2048,
               blend_min_tokens=16, blend_max_deviation=math.inf)
    return build_engine(EngineConfig(**cfg)), build_engine(EngineConfig(**cfg, blend_key_shift=False))


# measured when written: ratio 0: mean KL 0.058 with the shift, 0.160 without; ratio 0.15: 0.020 vs 0.034
@pytest.mark.parametrize("ratio, at_most", [(0.0, 0.5), (0.15, 0.8)])
def test_the_shift_brings_blended_logits_closer_to_full_prefill_on_smollm2(smollm2_engines, ratio, at_most):
    with_shift = first_token_kls(smollm2_engines[0], ratio)
    without = first_token_kls(smollm2_engines[1], ratio)
    print(f"ratio {ratio}: first-token KL with the shift {with_shift}, without {without}")
    assert statistics.fmean(with_shift) < at_most * statistics.fmean(without)
