"""Decode steps on static input buffers (engine/decode_inputs.py), padded to batch-size buckets, against the
same engine building each step's inputs afresh: the same tokens and logprobs, the same KV in every block but
the scratch block the padding rows write, and the fallbacks (prefill, mixed steps) still dynamic. On the CPU
with the torch attention here; tests/engine/test_engine_triton.py runs the Triton path (static by default)."""
from __future__ import annotations

import random

import pytest
import torch

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig, cuda_graphs_problem
from reuse_server.engine.decode_inputs import StaticDecodeInputs, bucket_for, decode_buckets, is_plain_decode
from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.engine.scheduler import StepSlice
from reuse_server.engine.sequence import Sequence
from tiny_checkpoint import write_tiny_checkpoint

SEED = 4545
BS = 4
MAX_SEQS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=7)


def test_buckets_are_powers_of_two_to_eight_then_every_sixteen_up_to_the_batch_limit():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    buckets = decode_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 33, 40, 41)] == [1, 2, 4, 8, 8, 16, 32, 40, 40, None]
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_only_a_step_of_one_sampled_token_per_sequence_without_blending_is_a_plain_decode():
    seq = Sequence("a", [5, 6, 7], SamplingParams(max_tokens=4))
    one = StepSlice(seq, 1)
    assert is_plain_decode([one, one], [True, True], {})
    assert not is_plain_decode([], [], {})
    assert not is_plain_decode([one, StepSlice(seq, 2)], [True, True], {})  # a prefill slice beside it: mixed
    assert not is_plain_decode([one], [False], {})  # a slice whose logits nobody samples
    assert not is_plain_decode([one], [True], {0: object()})  # blending chooses rows


def test_cuda_graphs_are_refused_off_cuda_and_with_an_attention_that_cannot_be_captured():
    assert "CUDA device" in cuda_graphs_problem("cpu", "auto")
    assert "attention-backend torch" in cuda_graphs_problem("cuda", "torch")
    assert cuda_graphs_problem("cuda:1", "auto") is None and cuda_graphs_problem("cuda", "triton") is None
    with pytest.raises(ValueError, match="CUDA device"):
        EngineConfig(device="cpu", cuda_graphs=True).validate()


def test_the_cli_refuses_cuda_graphs_on_the_cpu_before_loading_anything(capsys):
    from reuse_server.server import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--cuda-graphs", "--device", "cpu"])
    assert exit_.value.code == 2
    assert "--cuda-graphs captures CUDA graphs of the decode step: it needs a CUDA device, not cpu" in \
        capsys.readouterr().err


def hold_one_block(engine) -> int:
    """Take a block out of the engine's cache for good (as the builder holds the scratch block back), one
    after a block the requests then use: a padding row that wrote anywhere but the scratch block would land
    in their KV."""
    first, held = engine.cache.allocate(2)
    engine.cache.free([first])
    return held


def test_the_flag_reaches_the_engine_config_and_is_off_by_default():
    from reuse_server.server.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["serve", "--cuda-graphs", "--device", "cuda"])).cuda_graphs
    assert not engine_config(build_parser().parse_args(["serve"])).cuda_graphs


def engine_pair(path):
    """(dynamic engine, static engine) on the same weights, each with one block held out of its cache (the
    static one's scratch block; the dynamic one's held alike, so both hand out the same block ids)."""
    cfg = dict(model=str(path), device="cpu", attention_backend="torch", block_size=BS, num_gpu_blocks=96,
               max_num_seqs=MAX_SEQS, max_num_batched_tokens=64, blend_key_shift=False, max_model_len=128)
    dynamic, static = build_engine(EngineConfig(**cfg)), build_engine(EngineConfig(**cfg))
    scratch = hold_one_block(static)
    assert hold_one_block(dynamic) == scratch
    static.runner.decode_inputs = StaticDecodeInputs(MAX_SEQS, 128 // BS, BS, scratch, "cpu")
    return dynamic, static, scratch


def run(engine, requests):
    """Add every request, step to the end; request id -> (token ids, logprobs); and the decode batch sizes."""
    for rid, prompt, max_tokens in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3,
                                                       ignore_eos=True))
    outs = {rid: ([], []) for rid, _, _ in requests}
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id][0].extend(out.new_token_ids)
            outs[out.request_id][1].extend(out.logprobs or [])
    return outs


def test_static_decode_steps_answer_as_dynamic_ones_and_padding_writes_only_the_scratch_block(llama):
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    dynamic, static, scratch = engine_pair(llama)
    vocab = dynamic.vocab_size
    # five requests of different lengths finishing at different steps: decode batches of 5, 4, 3, 2 and 1
    # rows, padded to the buckets 8, 4, 4, 2 and 1
    requests = [(f"r{i}", [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 19))], 2 + 3 * i)
                for i in range(5)]
    theirs, ours = run(dynamic, requests), run(static, requests)
    for rid, (ids, lps) in theirs.items():
        assert ours[rid][0] == ids, rid
        for a, b in zip(ours[rid][1], lps):
            # the same tokens; the values within float32 rounding (a product of 8 padded rows rounds apart from
            # one of 5 in the last bits)
            assert a.token_id == b.token_id and [t[0] for t in a.top] == [t[0] for t in b.top], rid
            assert [a.logprob] + [t[2] for t in a.top] == pytest.approx([b.logprob] + [t[2] for t in b.top],
                                                                        rel=1e-5, abs=1e-5), rid
    assert static.runner.steps["static"] > 0 and static.runner.steps["dynamic"] > 0  # the prefills stay dynamic
    assert dynamic.runner.steps["static"] == 0
    loads = static.runner.decode_inputs.loads
    assert {8, 4, 2, 1} <= set(loads), loads
    # every block the requests used holds the same KV either way; the padding rows wrote the scratch block alone
    mine, other = static.pool._data, dynamic.pool._data
    blocks = [b for b in range(static.pool.num_blocks) if b != scratch]
    torch.testing.assert_close(mine[:, :, blocks], other[:, :, blocks], rtol=1e-5, atol=1e-5)
    assert bool(mine[:, :, scratch].abs().sum() > 0) and not bool(other[:, :, scratch].abs().sum() > 0)


def test_a_batch_wider_than_the_buffers_or_a_table_longer_than_them_runs_dynamically(llama):
    _, static, scratch = engine_pair(llama)
    static.runner.decode_inputs = StaticDecodeInputs(2, 3, BS, scratch, "cpu")  # 2 rows of 3 blocks at most
    rng = random.Random(SEED + 1)
    vocab = static.vocab_size
    short = [(f"s{i}", [rng.randrange(3, vocab) for _ in range(5)], 3) for i in range(3)]
    run(static, short)  # three rows: no bucket holds them until one finishes
    assert static.runner.steps["static"] == 0
    run(static, [("long", [rng.randrange(3, vocab) for _ in range(11)], 4)])  # 12 to 14 tokens: 3 to 4 blocks
    assert static.runner.steps["static"] == 1 and static.runner.decode_inputs.loads == {1: 1}


def test_a_triton_kernel_gets_its_plan_on_the_buffers_for_the_steps_own_positions():
    """The forward looks the kernel's plan up by the positions tensor it is given: the static plan must be
    the one found for the step's positions (else every layer would plan afresh, and a graph could not be
    captured), with one tile per row, padding included, and the kernel's forced splits."""
    pytest.importorskip("triton")
    from reuse_server.engine.decode_inputs import StaticTritonPlan
    from reuse_server.model.attention_triton import TritonAttentionKernel

    inputs = StaticDecodeInputs(8, 4, BS, 30, "cpu", heads=(4, 2, 16))
    step = inputs.load([(11, 5, [3, 4], 6), (12, 0, [7], 1), (13, 9, [1, 2, 5], 10)], 4, TritonAttentionKernel(splits=2))

    def planned_afresh():
        raise AssertionError("the step's plan was not found")

    plan = step.meta.kernel_plan(step.positions, planned_afresh)
    assert isinstance(plan, StaticTritonPlan) and plan.num_tiles == 4 and plan.splits_for(2) == 2
    assert plan.tiles.tolist() == [[0, 1, 6, 0], [1, 2, 1, 4], [2, 3, 10, 8], [3, 4, 1, 12]]
    assert plan.tables[:16].view(4, 4)[:, 0].tolist() == [3, 7, 1, 30] and plan.tables[8:11].tolist() == [1, 2, 5]
    assert step.input_ids.tolist() == [11, 12, 13, 0] and step.positions.tolist() == [5, 0, 9, 0]
    assert step.meta.slot_mapping.tolist() == [4 * 4 + 1, 7 * 4, 5 * 4 + 1, 30 * 4]
    assert step.meta.context_lens == [6, 1, 10, 1]
    # the torch attention plans for itself from the same metadata: no plan is handed to it
    torch_step = inputs.load([(11, 5, [3, 4], 6)], 1, None)
    assert torch_step.meta.kernel_plan(torch_step.positions, lambda: "its own") == "its own"

