"""The engine with its model and pool on a device that is not the CPU (tests/fake_gpu.py: a GPU faked on the
CPU, which raises when an op mixes device and host tensors and records every read of device values on the
host): every function that takes tensors from two owners (the Blender and the pool, re-RoPE and the pool,
the tiers and the pool, the sampler) runs there as on the CPU, and a step reads the device once."""
from __future__ import annotations

import math
import random

import pytest
import torch

from fake_gpu import DEVICE, FakeGPU
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from tiny_checkpoint import write_tiny_checkpoint

BS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def make_engine(path, device: str, **kw):
    cfg = dict(model=str(path), device=device, block_size=BS, num_gpu_blocks=128, max_num_seqs=4,
               max_num_batched_tokens=64, enable_blend=True, blend_min_tokens=8, blend_key_shift=False,
               blend_max_deviation=math.inf)  # the fidelity check off: a random checkpoint's deviations mean nothing
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg))


def drain(engine, gpu: FakeGPU | None = None, syncs_per_step: list | None = None) -> dict:
    outs: dict = {}
    while engine.has_work():
        before = len(gpu.syncs) if gpu is not None else 0
        step = engine.step()
        if syncs_per_step is not None:
            syncs_per_step.append((sum(bool(o.new_token_ids) for o in step), gpu.syncs[before:]))
        for out in step:
            ids, lps, _ = outs.get(out.request_id, ([], [], None))
            outs[out.request_id] = (ids + out.new_token_ids, lps + (out.logprobs or []), out)
    return outs


def on_fake_gpu(run):
    """run(device) on the fake GPU, everything made inside it (as torch needs for a wrapper tensor viewed in
    inference mode, where the engine steps)."""
    with torch.inference_mode(), FakeGPU() as gpu:
        return run(str(DEVICE), gpu)


def blended_run(path, device: str, **kw):
    """Two chunks precomputed alone (POST /v1/cache/chunks' engine call), then a prompt reusing both in the other
    order at new positions (re-RoPE into the pool): greedy tokens, logprobs, blended token count."""
    engine = make_engine(path, device, **kw)
    rng = random.Random(0)
    parts = [[rng.randrange(3, 300) for _ in range(n)] for n in (13, 18)]
    for i, part in enumerate(parts):
        engine.precompute(f"pre{i}", part, CacheOptions(chunk_spans=[(0, len(part))]))
        assert drain(engine)[f"pre{i}"][2].chunk_tokens_stored == len(part)
    ids = [5, 6, 7] + parts[1] + parts[0] + [9, 10]
    engine.add_request("b", ids, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True),
                       CacheOptions(chunk_spans=[(3, 18), (21, 13)], blend=True, recompute_ratio=0.3))
    tokens, logprobs, out = drain(engine)["b"]
    engine.cache.check_invariants()
    return tokens, [(lp.token_id, lp.logprob, [t for t, _, _ in lp.top]) for lp in logprobs], out.blended_tokens


# the fidelity check measuring every chunk (its sums taken from the device) at a threshold none reaches
MEASURE_ONLY = 1e9


@pytest.mark.parametrize("kw", [dict(), dict(kv_dtype="int8"), dict(kv_dtype="fp8_e4m3"),
                                dict(blend_query_weight=1.0), dict(blend_key_shift=True),
                                dict(blend_max_deviation=MEASURE_ONLY),
                                dict(blend_max_deviation=MEASURE_ONLY, blend_selection="epic")],
                         ids=["fp32", "int8", "fp8", "query-weight", "key-shift", "fidelity-check",
                              "fidelity-check-epic"])
def test_blending_with_the_pool_on_a_device_gives_the_cpu_s_answer(checkpoint, kw):
    """The Blender counts positions on the host and the pool's keys are on the device: re-RoPE used to get
    them as they were (`old_pos is on cpu, k_cache on cuda:0`), and the first blended prompt stopped the
    engine."""
    cpu = blended_run(checkpoint, "cpu", **kw)
    device = on_fake_gpu(lambda dev, gpu: blended_run(checkpoint, dev, **kw))
    assert cpu[2] > 0  # chunks were reused, not recomputed
    assert device[0] == cpu[0] and device[2] == cpu[2]
    for (t1, lp1, top1), (t2, lp2, top2) in zip(device[1], cpu[1]):
        # an 8-bit pool is read by the CPU's kernels on the CPU, dequantized by torch elsewhere: one rounding apart
        assert t1 == t2 and top1 == top2 and lp1 == pytest.approx(lp2, abs=1e-5 if "kv_dtype" not in kw else 1e-3)


SAMPLING = [SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3,
                           repetition_penalty=1.3, logit_bias={7: 2.0}, logprobs=0, ignore_eos=True)]


def test_a_step_reads_the_device_once_and_greedy_answers_match_the_cpu(checkpoint):
    """Every step of a batch mixing greedy with logprobs, random sampling (top-k, top-p) and penalties with a
    logit bias reads the device back once (the sampled ids and logprobs in one copy, nothing in the forward);
    greedy tokens and logprobs are the CPU's."""
    seed = random.randrange(1 << 30)
    print("prompt seed", seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (11, 6, 9)]

    def run(device, gpu=None):
        engine = make_engine(checkpoint, device)
        for i, (ids, params) in enumerate(zip(prompts, SAMPLING)):
            engine.add_request(f"r{i}", ids, params)
        per_step = [] if gpu is not None else None
        return drain(engine, gpu, per_step), per_step

    cpu, _ = run("cpu")
    device, per_step = on_fake_gpu(run)
    assert len(per_step) >= 5
    for sampled, syncs in per_step:
        assert len(syncs) == (1 if sampled else 0), syncs
    for rid in ("r0", "r2"):  # the greedy ones
        assert device[rid][0] == cpu[rid][0]
        for a, b in zip(device[rid][1], cpu[rid][1]):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
    assert len(device["r1"][0]) == 5 and len(device["r0"][1]) == 5


def test_blocks_leave_a_device_pool_for_host_ram_and_come_back(checkpoint):
    """The tiers take blocks out of a device pool and put them back: the answer after everything was evicted
    to host RAM is the cold one, and its prompt came from the host tier."""
    rng = random.Random(5)
    ids = [rng.randrange(3, 300) for _ in range(30)]
    fillers = [[rng.randrange(3, 300) for _ in range(60)] for _ in range(2)]

    def run(device, gpu=None):
        engine = make_engine(checkpoint, device, num_gpu_blocks=24, cpu_cache_size=10**7, enable_blend=False)
        params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)
        engine.add_request("cold", ids, params)
        cold = drain(engine)["cold"]
        for i, filler in enumerate(fillers):  # need the whole pool
            engine.add_request(f"filler{i}", filler, SamplingParams(max_tokens=1, ignore_eos=True))
            drain(engine)
        assert engine.cache.match(ids, b"", record_stats=False).num_tokens == 0
        engine.add_request("again", ids, params)
        again = drain(engine)["again"]
        engine.cache.check_invariants()
        return cold, again

    cold, again = on_fake_gpu(run)
    assert again[2].tier_tokens.get("host", 0) >= (len(ids) - 1) // BS * BS
    assert again[0] == cold[0]
    assert [lp.logprob for lp in again[1]] == pytest.approx([lp.logprob for lp in cold[1]], abs=1e-5)
