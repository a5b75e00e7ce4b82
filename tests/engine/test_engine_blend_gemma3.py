"""Blending on Gemma 3, whose sliding layers rotate keys with RoPE base 10,000 and whose global layers (every
sixth) with 1,000,000: a reused chunk's keys are moved with each layer's own base, the key shift is added
with it, and a blended request runs through the windowed layers and counts what it reused.

The model is a small random Gemma 3 written by transformers (6 layers: five sliding with a window of 16, the
last global), so the prompts below are longer than the window."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from blend.key_shift import unrope
from reuse_server.engine.blender import layer_inv_freq
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from test_engine_blend import BS, build_prompt, close, generate, passages, precompute, seq_kv
from test_engine_blend import make_engine as make_any_engine


def make_engine(path, **kw):
    """The sliding layers' pool with a part for every block (blending holds parts for its whole prompt)."""
    return make_any_engine(path, **{"window_kv_share": 1.0, **kw})
from tiny_checkpoint import write_tiny_checkpoint

WINDOW = 16
LAYERS = 6
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gemma3"), arch="gemma3", seed=5, num_layers=LAYERS,
                                 sliding_window=WINDOW, rope_theta=GLOBAL_THETA)


def test_the_tiny_model_has_both_kinds_of_layer(checkpoint):
    """What the other tests rely on to mean anything: sliding and global layers with different bases."""
    engine = make_engine(checkpoint, blend_key_shift=False)
    config = engine.model.config
    assert [config.layer_window(i) for i in range(LAYERS)] == [WINDOW] * 5 + [None]
    assert [config.layer_rope_theta(i) for i in range(LAYERS)] == [LOCAL_THETA] * 5 + [GLOBAL_THETA]
    table = layer_inv_freq(engine.model)
    assert table.shape == (LAYERS, config.head_dim // 2)
    assert torch.equal(table[5], engine.model.rotary.inv_freq) and not torch.equal(table[0], table[5])


def reference_keys(checkpoint, ids: list[int], start: int) -> list[torch.Tensor]:
    """transformers' post-RoPE keys [n, kv_heads, head_dim] of every layer for `ids` computed alone at positions
    start .. start + n - 1 (the causal and window masks follow the tokens, RoPE the positions)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    cache = DynamicCache()  # plain layers: all of the chunk's keys are kept, also on the sliding layers
    with torch.no_grad():
        model(torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None], cache=cache,
              use_cache=True)
    return [layer.keys[0].transpose(0, 1) for layer in cache.layers]


@pytest.mark.parametrize("start", [40, 1000])
def test_a_moved_chunk_has_the_keys_computed_where_it_now_sits_in_every_layer(checkpoint, start):
    """RoPE is relative, so a chunk computed alone at 0..n-1 has, in every layer, the keys it has computed alone
    at start..start+n-1 up to the rotation; the blender's re-RoPE must give those keys, each layer rotated
    with its own base (one base for all layers puts the sliding layers' keys ~10 off, with |k| ~7)."""
    engine = make_engine(checkpoint, blend_key_shift=False)
    [chunk] = passages(20, engine.vocab_size, sizes=(24,))  # longer than the window
    precompute(engine, chunk, "pre")
    head = [3 + i % 50 for i in range(start)]
    ids, spans = build_prompt([chunk], head=head, question=[5, 6])
    engine.add_request("x", ids, SamplingParams(max_tokens=1), CacheOptions(chunk_spans=spans, blend=True))
    seq = engine.seqs["x"]
    engine.blocks.admit(seq, len(ids))
    assert engine.blender.open_job(seq) and bool(seq.blend.reused.any())  # the chunk was found and moved in
    slots = torch.tensor([seq.block_table[p // BS] * BS + p % BS for p in range(start, start + len(chunk))])
    moved = engine.pool.read_keys(slots)
    want = reference_keys(checkpoint, chunk, start)
    for layer in range(LAYERS):
        err = (moved[layer].float() - want[layer]).abs().max().item()
        assert err <= 1e-4 * want[layer].abs().max().item(), (layer, err)  # measured ~4e-5 of |k| ~7
    engine.abort("x")


def test_the_key_shift_is_added_with_each_layers_own_rotation(checkpoint):
    on, off = make_engine(checkpoint), make_engine(checkpoint, blend_key_shift=False)
    assert on.blender.key_shift is not None
    first, second = passages(21, on.vocab_size, sizes=(14, 17))
    ids, spans = build_prompt([first, second], head=[3, 4], question=[5])
    for engine in (on, off):  # the first chunk is filed alone
        generate(engine, "a", ids, spans, blend=True)
    ids, spans = build_prompt([second, first], head=[6] * 30, question=[5])  # now after other text
    keys = {}
    for name, engine in (("on", on), ("off", off)):
        engine.add_request("p", ids, SamplingParams(max_tokens=1), CacheOptions(chunk_spans=spans, blend=True))
        seq = engine.seqs["p"]
        engine.blocks.admit(seq, len(ids))
        assert engine.blender.open_job(seq)
        s, n = spans[1]
        keys[name] = engine.pool.read_keys(torch.tensor([seq.block_table[p // BS] * BS + p % BS
                                                         for p in range(s, s + n)]))
        engine.abort("p")
    pos = torch.arange(s, s + n)
    table = layer_inv_freq(on.model)
    for layer in range(LAYERS):
        delta = unrope(keys["on"][layer], pos, table[layer]) - unrope(keys["off"][layer], pos, table[layer])
        assert torch.allclose(delta, on.blender.key_shift.k[layer].expand_as(delta), atol=1e-4), layer


def test_ratio_one_reproduces_full_prefill(checkpoint):
    """Every reused token recomputed: the windowed layers of a blended prefill give a full prefill's answer."""
    blended = make_engine(checkpoint, blend_key_shift=False)
    full = make_engine(checkpoint, enable_blend=False)
    parts = passages(22, blended.vocab_size)
    for i, p in enumerate(parts):
        precompute(blended, p, f"pre{i}")
    ids, spans = build_prompt([parts[2], parts[0], parts[1]], head=[5, 6, 7], question=[9, 10, 11])
    assert len(ids) > 2 * WINDOW
    got = generate(blended, "b", ids, spans, blend=True, ratio=1.0)
    ref = generate(full, "f", ids, spans, blend=False)
    assert got[2].blended_tokens == 0 and got[2].recomputed_tokens == sum(len(p) for p in parts)
    assert got[0] == ref[0]
    close(got[1], ref[1], 1e-4)
    k1, v1 = seq_kv(blended, ids)
    k2, v2 = seq_kv(full, ids)
    assert torch.allclose(k1, k2, atol=1e-4, rtol=1e-4) and torch.allclose(v1, v2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_a_blended_request_answers_and_counts_what_it_reused(checkpoint, ratio):
    engine = make_engine(checkpoint)
    parts = passages(23, engine.vocab_size, sizes=(20, 20, 16))
    for i, p in enumerate(parts):
        precompute(engine, p, f"pre{i}")
    ids, spans = build_prompt(parts[::-1], head=[3, 3], question=[7, 8, 9])
    got_ids, logprobs, out = generate(engine, "b", ids, spans, blend=True, ratio=ratio, max_tokens=4)
    reused = sum(len(p) for p in parts)
    assert len(got_ids) == 4 and all(0 <= t < engine.vocab_size for t in got_ids)
    assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in logprobs)
    assert out.recomputed_tokens == round(ratio * reused) and out.blended_tokens == reused - out.recomputed_tokens
    assert out.cached_tokens == out.blended_tokens  # no prefix hit in this order: the blended tokens were not computed
    assert engine.snapshot()["blended_tokens"] == out.blended_tokens
    assert engine.cache.stats().in_use_blocks == 0


def test_a_blended_prompt_longer_than_the_sliding_layers_pool_is_computed_exactly(checkpoint):
    """Blending holds a window part for every block of its prompt until the prefill passes it; a prompt with
    more blocks than the sliding layers' pool has parts is computed exactly (the cold answer), not parked
    waiting for parts that can never be free together."""
    engine = make_any_engine(checkpoint, num_window_blocks=16, max_num_batched_tokens=16)
    full = make_engine(checkpoint, enable_blend=False)
    assert engine.pool.layered
    parts = passages(24, engine.vocab_size, sizes=(20, 20, 20))
    for i, p in enumerate(parts):
        precompute(engine, p, f"pre{i}")
    ids, spans = build_prompt(parts[::-1], head=[3, 3], question=[7, 8, 9])
    assert len(ids) // BS >= 16
    got = generate(engine, "b", ids, spans, blend=True)
    assert got[2].blended_tokens == 0 and got[2].recomputed_tokens == 0
    ref = generate(full, "f", ids, spans, blend=False)
    assert got[0] == ref[0]
    close(got[1], ref[1], 1e-4)
    assert engine.cache.stats().in_use_blocks == 0
