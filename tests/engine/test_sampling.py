"""Sampling and stop conditions: the knobs a client turns must do what they say."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.detokenizer import IncrementalDetokenizer
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampler import Sampler, SamplerState, adjust_logits
from reuse_server.engine.sampling_params import InvalidRequest, SamplingParams
from tiny_checkpoint import build_tokenizer, write_tiny_checkpoint


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler()
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6),
                   # found by the schema fuzzer: below float32's smallest value top_p compared as 0 and
                   # dropped every token, and sampling from nothing stopped the engine
                   SamplingParams(temperature=1.5, top_p=6.66e-68), SamplingParams(temperature=1.5, top_p=5e-324)):
        assert s.sample(logits, [SamplerState() for _ in range(6)], [params] * 6) == greedy


def test_a_vanishing_repetition_penalty_favours_the_seen_tokens_without_a_nan():
    """Found by the schema fuzzer: repetition_penalty 2.15e-46 is 0 in float32, a seen token's positive logit
    divided by it +inf, the softmax NaN, and sampling from it stopped the engine."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    seen = [int(logits[0].argmin()), int(logits[0].topk(3).indices[-1])]
    logits[:, seen] = torch.tensor([0.5, 2.0])  # both positive: divided by the penalty, both go to +inf
    params = SamplingParams(temperature=1.0, repetition_penalty=2.1548906879527825e-46)
    for seed in range(8):
        states = [SamplerState() for _ in range(4)]
        out = Sampler().sample(logits, states, [dataclasses.replace(params, seed=seed)] * 4,
                               [(seen, [])] * 4)
        assert set(out) <= set(seen)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-8])
def test_a_vanishing_temperature_is_greedy_not_a_nan(temperature):
    """Found by the schema fuzzer: logits divided by 1e-300 are inf, their softmax NaN, and sampling from it
    raised inside the engine step. Below 1e-5 a temperature samples as greedy (vLLM's threshold)."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * 30
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=5)
    params.validate()
    assert Sampler().sample(logits, [SamplerState() for _ in range(6)], [params] * 6) == logits.argmax(-1).tolist()


def test_top_k_never_samples_outside_the_k_best():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    best = set(torch.topk(logits, 3).indices.tolist())
    s = Sampler()
    seen = {s.sample(logits[None], [SamplerState()], [SamplingParams(temperature=2.0, top_k=3)])[0] for i in range(200)}
    assert seen <= best and len(seen) > 1


def test_seed_makes_sampling_reproducible_and_differs_between_seeds():
    logits = torch.zeros(1, 1000)  # uniform: any token is possible
    def draw(seed):
        s, state = Sampler(), SamplerState()  # the request's state carries its generator from token to token
        return [s.sample(logits, [state], [SamplingParams(temperature=1.0, seed=seed)])[0] for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_penalties_and_bias_follow_their_formulas():
    """OpenAI's frequency/presence penalties count the output only; the repetition penalty (prompt and output)
    divides a positive logit and multiplies a negative one; the bias is added last."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={4: -3.0, 0: 1.5})
    row = logits.clone()
    adjust_logits(row, params, prompt_ids=[1], output_ids=[3, 3, 2])
    expected = torch.tensor([2.0 + 1.5,            # unseen: only its bias
                             -1.0 * 2.0,           # seen in the prompt, negative: multiplied
                             0.5 / 2.0 - 0.5 - 0.25,  # generated once
                             3.0 / 2.0 - 1.0 - 0.25,  # generated twice
                             1.0 - 3.0])
    assert torch.allclose(row, expected)


def test_sampler_applies_penalties_before_the_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    plain, penalized = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, frequency_penalty=0.2)
    histories = [([], [0]), ([], [0])]
    assert Sampler().sample(logits, [SamplerState(), SamplerState()], [plain, penalized], histories) == [0, 1]
    assert Sampler().sample(logits, [SamplerState()], [SamplingParams(temperature=0.0, logit_bias={2: 5.0})]) == [2]
    assert torch.equal(logits, torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]]))  # the caller's logits are kept


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=0), dict(max_tokens=0),
                                 dict(logprobs=21), dict(stop=[""]), dict(seed=2**64), dict(presence_penalty=-2.1),
                                 dict(frequency_penalty=2.5), dict(repetition_penalty=0.0),
                                 dict(logit_bias={3: 100.5})])
def test_invalid_sampling_params_are_rejected(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad).validate()


def test_detokenizer_holds_back_a_possible_stop_string_and_cuts_at_it():
    tok = build_tokenizer()
    ids = tok.encode("hello world, stop here please", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=["stop here"])
    released = ""
    for i in range(1, len(ids) + 1):
        released += d.add(ids[:i])
        assert "stop" not in released
        if d.stopped:
            break
    released += d.flush()
    assert d.stopped and released == "hello world, "


def test_detokenizer_streams_exactly_the_full_decode():
    tok = build_tokenizer()
    text = "streaming text comes out piece by piece, éàü included"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=[])
    out = "".join(d.add(ids[:i]) for i in range(1, len(ids) + 1)) + d.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", seed=4)
    return build_engine(EngineConfig(model=str(path), block_size=4, num_gpu_blocks=128))


def generate(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    ids, text, last = [], "", None
    while engine.has_work():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
            last = out
    return ids, text, last


def test_stop_token_ids_end_generation_on_that_token(engine):
    prompt = [5, 6, 7, 8]
    free_run, _, _ = generate(engine, "a", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stop_at = free_run[4]
    ids, _, last = generate(engine, "b", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                stop_token_ids=[stop_at]))
    assert ids == free_run[:free_run.index(stop_at) + 1] and last.finish_reason == "stop"


def test_max_tokens_and_stop_strings(engine):
    prompt = [9, 10, 11]
    ids, text, last = generate(engine, "c", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(ids) == 10 and last.finish_reason == "length"
    at = next(i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    stop = text[at:at + 2]
    _, cut, last = generate(engine, "d", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                                stop=[stop]))
    assert cut == text[:text.index(stop)] and last.finish_reason == "stop"
    assert engine.cache.stats().in_use_blocks == 0


def test_an_output_limit_is_fitted_to_the_room_left_and_the_servers_cap(engine):
    """validate() returns the parameters to run with: a limit beyond the context (or none) becomes the room the
    prompt leaves (here the pool's 128 blocks of 4 tokens bound it), --max-tokens caps any limit, and the
    request's own smaller limit wins; the caller's parameters are left as they were."""
    room = engine.max_sequence_tokens - 6
    prompt = list(range(5, 11))
    for asked, fitted in [(32000, room), (None, room), (room, room), (7, 7)]:
        params = SamplingParams(max_tokens=asked)
        assert engine.validate(prompt, params).max_tokens == fitted and params.max_tokens == asked
    ids, _, last = generate(engine, "fill", prompt, SamplingParams(max_tokens=32000, temperature=0.0, ignore_eos=True))
    assert len(ids) == room and last.finish_reason == "length"
    engine.config.max_tokens = 9  # --max-tokens 9
    try:
        assert [engine.validate(prompt, SamplingParams(max_tokens=asked)).max_tokens
                for asked in (32000, None, 9, 4)] == [9, 9, 9, 4]
    finally:
        engine.config.max_tokens = None
    with pytest.raises(InvalidRequest) as err:  # a prompt that leaves no room stays an error
        engine.validate([5] * engine.max_sequence_tokens, SamplingParams(max_tokens=32000))
    assert err.value.code == "context_length_exceeded"
