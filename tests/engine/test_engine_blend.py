"""Blending inside the engine: chunk index hits, re-RoPE into place, selective recomputation."""
from __future__ import annotations

import math
import random

import pytest
import torch

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from tiny_checkpoint import write_tiny_checkpoint

BS = 4
MIN = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def make_engine(path, **kw) -> LLMEngine:
    # the fidelity check off: a random checkpoint's deviations say nothing of its text, and these tests count
    # what selection recomputes (the check has its own tests: test_engine_blend_fidelity.py)
    cfg = dict(model=str(path), block_size=BS, num_gpu_blocks=512, max_num_seqs=4, max_num_batched_tokens=64,
               enable_blend=True, blend_min_tokens=MIN, blend_max_deviation=math.inf)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg))


def drain(engine: LLMEngine) -> dict:
    outs: dict = {}
    while engine.has_work():
        for out in engine.step():
            ids, lps, _ = outs.get(out.request_id, ([], [], None))
            outs[out.request_id] = (ids + out.new_token_ids, lps + (out.logprobs or []), out)
        engine.cache.check_invariants()
    return outs


def precompute(engine: LLMEngine, chunk: list[int], rid: str) -> int:
    engine.precompute(rid, chunk, CacheOptions(chunk_spans=[(0, len(chunk))]))
    return drain(engine)[rid][2].chunk_tokens_stored


def passages(seed: int, vocab: int, sizes=(13, 18, 11)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in sizes]


def build_prompt(parts: list[list[int]], head: list[int], question: list[int]):
    ids, spans = list(head), []
    for p in parts:
        spans.append((len(ids), len(p)))
        ids += p
    return ids + question, spans


def generate(engine, rid, ids, spans, blend, ratio=None, max_tokens=4):
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True),
                       CacheOptions(chunk_spans=spans, blend=blend, recompute_ratio=ratio))
    return drain(engine)[rid]


def close(a, b, tol):
    for x, y in zip(a, b):
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) <= tol
        for (_, _, va), (_, _, vb) in zip(x.top, y.top):
            assert abs(va - vb) <= tol


def seq_kv(engine: LLMEngine, ids: list[int]):
    """K, V of a finished prompt's full blocks, read back through the radix tree."""
    full = (len(ids) - 1) // BS * BS
    m = engine.cache.match(ids[:full], b"", record_stats=False)
    assert m.num_tokens == full
    data = engine.pool.layout.decode(engine.pool.export_blocks(m.block_ids))  # [blocks, layers, 2, block, heads, dim]
    layers = engine.pool.num_layers
    ks = data[:, :, 0].transpose(0, 1).reshape(layers, full, -1)
    vs = data[:, :, 1].transpose(0, 1).reshape(layers, full, -1)
    return ks, vs


@pytest.mark.parametrize("query_weight,kv_dtype", [(0.0, "auto"), (1.0, "auto"), (0.0, "bf16"), (1.0, "fp8_e4m3"),
                                                   (0.0, "int8"), (1.0, "int8")])
def test_ratio_one_reproduces_full_prefill(checkpoint, query_weight, kv_dtype):
    # with query-aware selection on, the question's probe pass writes KV that the blended pass must replace;
    # on a quantized pool the reference is a full prefill on a pool of the same dtype
    blended = make_engine(checkpoint, blend_query_weight=query_weight, kv_dtype=kv_dtype)
    full = make_engine(checkpoint, enable_blend=False, kv_dtype=kv_dtype)
    parts = passages(0, blended.vocab_size)
    for i, p in enumerate(parts):
        assert precompute(blended, p, f"pre{i}") == len(p)
    ids, spans = build_prompt([parts[2], parts[0], parts[1]], head=[5, 6, 7], question=[9, 10, 11])
    got = generate(blended, "b", ids, spans, blend=True, ratio=1.0)
    ref = generate(full, "f", ids, spans, blend=False)
    out = got[2]
    assert out.blended_tokens == 0 and out.recomputed_tokens == sum(len(p) for p in parts)
    assert got[0] == ref[0]
    close(got[1], ref[1], 1e-4)
    k1, v1 = seq_kv(blended, ids)
    k2, v2 = seq_kv(full, ids)
    assert torch.allclose(k1, k2, atol=1e-4, rtol=1e-4) and torch.allclose(v1, v2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype,tol", [("auto", 1e-5), ("bf16", 2e-2), ("fp8_e4m3", 0.1), ("int8", 2e-2)])
def test_reused_keys_are_rotated_to_their_new_positions(checkpoint, kv_dtype, tol):
    """Layer-0 K depends only on token and position: a chunk cached at 0..n-1 and re-RoPE'd to q..q+n-1
    must equal the layer-0 keys a full prefill computes there (on a quantized pool: dequantized, rotated and
    requantized, so within two roundings of the format, relative to the largest key)."""
    engine = make_engine(checkpoint, kv_dtype=kv_dtype)
    full = make_engine(checkpoint, enable_blend=False, kv_dtype=kv_dtype)
    parts = passages(1, engine.vocab_size)
    for i, p in enumerate(parts):
        precompute(engine, p, f"pre{i}")
    ids, spans = build_prompt([parts[1], parts[2]], head=[4, 4, 4, 4, 4], question=[8, 8])
    generate(full, "f", ids, spans, blend=False)
    k_full, _ = seq_kv(full, ids)

    seq_ids = ids
    engine.add_request("x", seq_ids, SamplingParams(max_tokens=1), CacheOptions(chunk_spans=spans, blend=True))
    seq = engine.seqs["x"]
    assert engine.blocks.admit(seq, len(ids)).cached_tokens == 0
    assert engine.blender.open_job(seq)  # the chunks are found and copied in
    reused = seq.blend.reused
    assert reused.nonzero().flatten().tolist() == [p for start, n in spans for p in range(start, start + n)]
    for start, n in spans:
        n = min(n, k_full.shape[1] - start)  # the reference holds full blocks only
        slots = torch.tensor([seq.block_table[p // BS] * BS + p % BS for p in range(start, start + n)])
        k0, _ = engine.pool.read(0, slots)
        want = k_full[0, start:start + n]
        assert torch.allclose(k0.float().reshape(n, -1), want, atol=tol * float(want.abs().max()), rtol=tol)
    engine.abort("x")
    assert engine.cache.stats().in_use_blocks == 0


def test_ratio_zero_reuses_everything_and_counts_it(checkpoint):
    engine = make_engine(checkpoint)
    parts = passages(2, engine.vocab_size)
    for i, p in enumerate(parts):
        precompute(engine, p, f"pre{i}")
    ids, spans = build_prompt(parts[::-1], head=[3, 3], question=[7, 8, 9])
    out = generate(engine, "b", ids, spans, blend=True, ratio=0.0)[2]
    reused = sum(len(p) for p in parts)
    assert out.blended_tokens == reused and out.recomputed_tokens == 0
    assert out.cached_tokens == reused  # nothing of this order was a prefix hit
    snap = engine.snapshot()
    assert snap["blended_tokens"] == reused and snap["in_use_blocks"] == 0
    # the blended prompt is now a normal sequence in the tree: the same order again is an exact prefix hit
    again = generate(engine, "c", ids, spans, blend=True, ratio=0.0)[2]
    assert again.cached_tokens == len(ids) - 1 and again.blended_tokens == 0


def test_ratio_selects_the_requested_share(checkpoint):
    engine = make_engine(checkpoint)
    parts = passages(3, engine.vocab_size, sizes=(20, 20))
    for i, p in enumerate(parts):
        precompute(engine, p, f"pre{i}")
    ids, spans = build_prompt(parts[::-1], head=[3], question=[7])
    out = generate(engine, "b", ids, spans, blend=True, ratio=0.25)[2]
    assert out.recomputed_tokens == 10 and out.blended_tokens == 30


def test_no_reusable_chunk_behaves_as_without_blending(checkpoint):
    on = make_engine(checkpoint)
    off = make_engine(checkpoint, enable_blend=False)
    parts = passages(4, on.vocab_size)
    ids, spans = build_prompt(parts, head=[3, 4], question=[5])
    a = generate(on, "a", ids, spans, blend=True)
    b = generate(off, "b", ids, spans, blend=False)
    assert a[0] == b[0]
    close(a[1], b[1], 0.0)
    assert a[2].blended_tokens == 0 and a[2].cached_tokens == b[2].cached_tokens == 0


def test_ordinary_traffic_fills_the_chunk_index(checkpoint):
    engine = make_engine(checkpoint)
    parts = passages(5, engine.vocab_size)
    ids, spans = build_prompt(parts, head=[3, 4], question=[5])
    generate(engine, "a", ids, spans, blend=True)
    for p in parts:
        assert engine.chunk_index.contains(p)
    ids2, spans2 = build_prompt(parts[::-1], head=[6], question=[5])
    out = generate(engine, "b", ids2, spans2, blend=True, ratio=0.0)[2]
    assert out.blended_tokens == sum(len(p) for p in parts)


def test_chunk_blocks_are_evictable_like_any_cached_block(checkpoint):
    engine = make_engine(checkpoint, num_gpu_blocks=40)
    parts = passages(6, engine.vocab_size, sizes=(16, 16))
    for i, p in enumerate(parts):
        precompute(engine, p, f"pre{i}")
    s = engine.cache.stats()
    assert s.in_use_blocks == 0 and s.evictable_blocks > 0
    # a long unrelated request needs nearly the whole pool: chunk blocks get evicted, nothing leaks
    rng = random.Random(9)
    long = [rng.randrange(3, engine.vocab_size) for _ in range(140)]
    generate(engine, "big", long, [], blend=False, max_tokens=2)
    s = engine.cache.stats()
    assert s.evicted_blocks > 0 and s.in_use_blocks == 0
    assert s.free_blocks + s.evictable_blocks == s.total_blocks


def reversed_precomputed_prompt(engine: LLMEngine, seed: int):
    """Three passages precomputed into the chunk index, then a prompt with them in reverse order."""
    parts = passages(seed, engine.vocab_size)
    for i, p in enumerate(parts):
        precompute(engine, p, f"pre{i}")
    return build_prompt(parts[::-1], head=[3, 4, 5, 6, 7], question=[8, 9])


def test_blended_kv_never_serves_a_request_that_did_not_ask_for_blending(checkpoint):
    engine = make_engine(checkpoint)
    exact = make_engine(checkpoint, enable_blend=False)
    ids, spans = reversed_precomputed_prompt(engine, seed=7)
    blended = generate(engine, "b", ids, spans, blend=True, ratio=0.0)
    assert blended[2].blended_tokens > 0
    # a blending request repeating the same order is an exact prefix hit on the blended KV
    again = generate(engine, "again", ids, spans, blend=True, ratio=0.0)
    assert again[2].cached_tokens == len(ids) - 1 and again[2].blended_tokens == 0
    assert again[0] == blended[0]
    plain = generate(engine, "p", ids, spans, blend=False)
    reference = generate(exact, "r", ids, spans, blend=False)
    # the blended sequence was filed under the approximate namespace only: nothing of it serves this request
    assert plain[2].cached_tokens == 0 and plain[2].blended_tokens == 0
    assert plain[0] == reference[0]
    close(plain[1], reference[1], 1e-5)
    assert engine.cache.stats().in_use_blocks == 0


def test_blended_kv_serves_only_requests_blending_with_the_same_ratio(checkpoint):
    engine = make_engine(checkpoint)
    ids, spans = reversed_precomputed_prompt(engine, seed=17)
    reusable = len(ids) - 1  # every prompt token but the last, whose logits start generation
    naive = generate(engine, "naive", ids, spans, blend=True, ratio=0.0)[2]
    assert naive.blended_tokens > 0 and naive.recomputed_tokens == 0
    # asking for more recomputation must not be served the cheaper blend of the same prompt
    careful = generate(engine, "careful", ids, spans, blend=True, ratio=0.5)[2]
    assert careful.recomputed_tokens > 0 and careful.cached_tokens < reusable + careful.blended_tokens
    for rid, ratio in (("naive-again", 0.0), ("careful-again", 0.5)):
        again = generate(engine, rid, ids, spans, blend=True, ratio=ratio)[2]
        assert again.cached_tokens == reusable and again.blended_tokens == 0 and again.recomputed_tokens == 0
    assert engine.cache.stats().in_use_blocks == 0


def test_blended_kv_is_keyed_by_the_selection_settings_too(checkpoint):
    engine = make_engine(checkpoint)
    ids, spans = reversed_precomputed_prompt(engine, seed=18)
    reusable = len(ids) - 1
    assert generate(engine, "kv", ids, spans, blend=True, ratio=0.5)[2].recomputed_tokens > 0
    engine.blender.settings.score = "k"  # as if the server had been started with --blend-score k
    by_k = generate(engine, "k", ids, spans, blend=True, ratio=0.5)[2]
    assert by_k.recomputed_tokens > 0 and by_k.cached_tokens < reusable + by_k.blended_tokens
    engine.blender.settings.score = "kv"
    again = generate(engine, "kv-again", ids, spans, blend=True, ratio=0.5)[2]
    assert again.cached_tokens == reusable and again.recomputed_tokens == 0
    assert engine.cache.stats().in_use_blocks == 0


def test_a_chunk_that_starts_inside_the_prefix_hit_is_still_blended(checkpoint):
    engine = make_engine(checkpoint)
    chunk = passages(8, engine.vocab_size, sizes=(24,))[0]
    precompute(engine, chunk, "pre")
    head = [3, 4, 5]
    first, _ = build_prompt([chunk[:9]], head=head, question=[])
    generate(engine, "warm", first, [], blend=False, max_tokens=1)  # caches head + chunk[:9]: 3 full blocks
    ids, spans = build_prompt([chunk], head=head, question=[7, 8])
    out = generate(engine, "b", ids, spans, blend=True, ratio=0.0)[2]
    # 12 tokens come from the exact prefix, the rest of the chunk from the chunk index
    assert out.cached_tokens == 12 + (24 - 9) and out.blended_tokens == 24 - 9


@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_a_blended_prefill_batched_with_decodes_and_prefills_gives_what_it_gives_alone(checkpoint, ratio):
    """A blended prefill runs through the same forward as everything else: in one step with other requests'
    decodes and plain prefills it selects the same rows and gives the same tokens as alone."""
    alone_engine, busy_engine = make_engine(checkpoint), make_engine(checkpoint, max_num_batched_tokens=256)
    rng = random.Random(21)
    outs = {}
    for name, engine in (("alone", alone_engine), ("busy", busy_engine)):
        ids, spans = reversed_precomputed_prompt(engine, seed=21)
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
        steps_together = 0
        if name == "busy":
            for i in range(2):  # two requests already decoding when the blended one arrives
                engine.add_request(f"d{i}", [rng.randrange(3, 200) for _ in range(9)],
                                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            engine.step()
            engine.add_request("p", [rng.randrange(3, 200) for _ in range(30)], params)  # a plain prefill
        engine.add_request("b", ids, params, CacheOptions(chunk_spans=spans, blend=True, recompute_ratio=ratio))
        got: dict = {}
        while engine.has_work():
            kinds = {s.request_id: s.is_prefilling for s in engine.scheduler.running + list(engine.scheduler.waiting)}
            step = engine.step()
            if name == "busy" and kinds.get("b") is not None and kinds.get("p") and "d0" in kinds:
                steps_together += 1
            for out in step:
                t, lps, _ = got.get(out.request_id, ([], [], None))
                got[out.request_id] = (t + out.new_token_ids, lps + (out.logprobs or []), out)
            engine.cache.check_invariants()
        outs[name] = got["b"]
        if name == "busy":
            assert steps_together >= 1  # the blended prefill shared a step with a decode and a prefill
        assert engine.cache.stats().in_use_blocks == 0
    alone, busy = outs["alone"], outs["busy"]
    assert alone[2].blended_tokens > 0
    assert (busy[2].blended_tokens, busy[2].recomputed_tokens) == (alone[2].blended_tokens, alone[2].recomputed_tokens)
    assert busy[0] == alone[0]
    close(busy[1], alone[1], 1e-4)


def test_a_blended_prompt_longer_than_the_step_budget_is_prefilled_in_slices(checkpoint):
    """Within the token budget like any prefill: a blended prompt of 47 tokens with a budget of 16 takes
    several steps; at ratio 1 every reused token is recomputed in its slice, which is a full prefill."""
    blended = make_engine(checkpoint, max_num_batched_tokens=16)
    full = make_engine(checkpoint, enable_blend=False)
    ids, spans = reversed_precomputed_prompt(blended, seed=22)
    blended.add_request("b", ids, SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True),
                        CacheOptions(chunk_spans=spans, blend=True, recompute_ratio=1.0))
    prefill_steps, got = 0, ([], [], None)
    while blended.has_work():
        prefilling = blended.seqs["b"].num_computed < len(ids)
        outs = blended.step()
        prefill_steps += prefilling
        for out in outs:
            got = (got[0] + out.new_token_ids, got[1] + (out.logprobs or []), out)
    assert prefill_steps >= -(-len(ids) // 16)
    ref = generate(full, "f", ids, spans, blend=False)
    assert got[2].recomputed_tokens == sum(n for _, n in spans) and got[2].blended_tokens == 0
    assert got[0] == ref[0]
    close(got[1], ref[1], 1e-4)
