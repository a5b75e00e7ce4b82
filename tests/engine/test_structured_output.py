"""Constrained decoding in the sampler: grammars compiled for the tokenizer (and cached), one bitmask applied
to a batch's constrained rows, a matcher per request advanced by every sampled token and dropped when the
request is forgotten."""
import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr

from reuse_server.engine.sampler import Sampler, SamplerState
from reuse_server.engine.sampling_params import InvalidRequest, SamplingParams
from reuse_server.engine.structured_output import Constraint, GrammarCompiler, apply_bitmask_
from tiny_checkpoint import build_tokenizer

SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Lima", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 30},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["city", "days", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def schema_constraint(schema=SCHEMA) -> Constraint:
    return Constraint("json_schema", json.dumps(schema), "response_format")


@pytest.mark.parametrize("vocab", [320, 49152, 151936])
def test_apply_bitmask_matches_xgrammars_own(vocab):
    seed = random.randrange(2**32)
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [0, 2, 3]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    ours, reference = logits.clone(), logits.clone()
    apply_bitmask_(ours, bitmask, rows)
    batch_mask = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)  # xgrammar's: one row per logits row
    batch_mask[rows] = bitmask
    xgr.apply_token_bitmask_inplace(reference, batch_mask, indices=rows, backend="cpu")
    assert torch.equal(ours, reference)
    assert torch.equal(ours[[1, 4]], logits[[1, 4]])  # rows without a mask are untouched
    allowed = ours[rows[0]] > float("-inf")
    expected = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert allowed.tolist() == [bool(b) for b in expected]


def generate(sampler, tokenizer, request_params: dict[str, SamplingParams], seed: int, max_steps: int = 200):
    """Sample every request from random logits (a batch per step) until each ends with EOS; their texts."""
    gen = torch.Generator().manual_seed(seed)
    outputs = {rid: [] for rid in request_params}
    states = {rid: SamplerState(rid) for rid in request_params}  # each request's, kept from token to token
    live = list(request_params)
    for _ in range(max_steps):
        if not live:
            break
        logits = torch.randn(len(live), len(tokenizer), generator=gen) * 3
        raw = logits.clone()
        tokens = sampler.sample(logits, [states[r] for r in live], [request_params[r] for r in live])
        assert torch.equal(logits, raw), "the caller's logits (used for logprobs) stay as they were"
        for rid, token in zip(list(live), tokens):
            if token == tokenizer.eos_token_id:
                live.remove(rid)
            else:
                outputs[rid].append(token)
    return {rid: tokenizer.decode(ids) for rid, ids in outputs.items()}, live


def test_constrained_rows_follow_their_grammar_in_a_mixed_batch(grammars, tokenizer):
    seed = random.randrange(2**32)
    print("seed", seed)
    grammar = grammars.compile(schema_constraint())
    obj = grammars.compile(Constraint("json_object", json.dumps({"type": "object"}), "response_format"))
    params = {"greedy-json": SamplingParams(temperature=0.0, grammar=grammar),
              "sampled-json": SamplingParams(temperature=1.0, seed=7, grammar=grammar),
              "free": SamplingParams(temperature=0.0, max_tokens=5)}
    sampler = Sampler()
    texts, unfinished = generate(sampler, tokenizer, {k: v for k, v in params.items() if k != "free"}, seed)
    assert not unfinished
    for rid in ("greedy-json", "sampled-json"):
        jsonschema.validate(json.loads(texts[rid]), SCHEMA)
    # the unconstrained row of a mixed batch is chosen from its raw logits
    logits = torch.randn(3, len(tokenizer), generator=torch.Generator().manual_seed(seed))
    tokens = sampler.sample(logits, [SamplerState("free"), SamplerState("o1"), SamplerState("greedy-2")],
                            [params["free"], SamplingParams(temperature=0.0, grammar=obj), params["greedy-json"]])
    assert tokens[0] == int(logits[0].argmax())
    assert tokenizer.decode([tokens[1]]).startswith("{") and tokenizer.decode([tokens[2]]).startswith("{")


def test_a_matcher_lives_as_long_as_its_request(grammars, tokenizer):
    grammar = grammars.compile(schema_constraint({"enum": ["Paris"]}))  # one possible output: "Paris" quoted
    sampler = Sampler()
    p = SamplingParams(temperature=0.0, grammar=grammar)
    logits = torch.zeros(1, len(tokenizer))
    request = SamplerState("r")
    first = sampler.sample(logits, [request], [p])[0]
    assert tokenizer.decode([first]) and '"Paris"'.startswith(tokenizer.decode([first]))
    second = sampler.sample(logits, [request], [p])[0]  # the matcher moved on: the next piece of the same string
    assert '"Paris"'.startswith(tokenizer.decode([first, second]))
    assert request.matcher is not None
    assert sampler.sample(logits, [SamplerState("r")], [p])[0] == first  # a new request (same id) starts over


def test_compiled_grammars_are_cached(grammars):
    grammars.compile(schema_constraint({"type": "object", "properties": {"zz": {"type": "integer"}}}))
    size = grammars._xgr_compiler().get_cache_size_bytes()
    grammars.compile(schema_constraint({"type": "object", "properties": {"zz": {"type": "integer"}}}))
    assert grammars._xgr_compiler().get_cache_size_bytes() == size
    grammars.compile(schema_constraint({"type": "object", "properties": {"yy": {"type": "integer"}}}))
    assert grammars._xgr_compiler().get_cache_size_bytes() > size


@pytest.mark.parametrize("schema, words", [
    ({"type": "wizard"}, ["wizard"]),
    ({"type": "object", "required": "city"}, ["required"]),
    ({"type": "string", "pattern": "(["}, ["Regex"]),
    ({"$ref": "#/$defs/missing"}, ["missing"]),
])
def test_schemas_that_cannot_compile_are_a_clear_client_error(grammars, schema, words):
    with pytest.raises(InvalidRequest) as err:
        grammars.compile(schema_constraint(schema))
    assert err.value.param == "response_format"
    assert all(w in err.value.message for w in words) and ".cc:" not in err.value.message


def test_constrained_output_refuses_ignore_eos(grammars):
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(ignore_eos=True, grammar=grammars.compile(schema_constraint())).validate()


def test_free_text_before_a_tool_call_is_sampled_from_the_raw_logits(grammars, tokenizer):
    """tool_choice auto: until the model writes "<tool_call>" every token is allowed, so the row is not masked;
    a JSON row in the same batch is."""
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"type": "tag", "begin": '<tool_call>\n{"name": "f", "arguments": ',
         "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "}\n</tool_call>"}]}}
    auto = grammars.compile(Constraint("structural_tag", json.dumps(tag), "tools"))
    json_row = grammars.compile(schema_constraint())
    seed = random.randrange(2**32)
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    sampler, states = Sampler(), [SamplerState("auto"), SamplerState("json")]
    for step in range(5):
        logits = torch.randn(2, len(tokenizer), generator=gen)
        logits[:, tokenizer.convert_tokens_to_ids("<")] = -50.0  # stay in free text
        tokens = sampler.sample(logits, states, [SamplingParams(temperature=0.0, grammar=auto),
                                                             SamplingParams(temperature=0.0, grammar=json_row)])
        assert tokens[0] == int(logits[0].argmax())
        if step == 0:
            assert tokenizer.decode([tokens[1]]).startswith("{")


def test_forced_text_comes_in_the_tokenizers_own_tokens(grammars, tokenizer):
    """When the grammar allows only one text, the model may still split it many ways; the mask lets only the
    tokenizer's own split through (all but the last token, which may merge with what follows), so a client
    that sends the text back, tokenized the usual way, repeats the same tokens."""
    text = "The quick brown fox jumps over the lazy dog."
    grammar = grammars.compile(schema_constraint({"enum": [text]}))
    canonical = tokenizer.encode(json.dumps(text), add_special_tokens=False)
    seed = random.randrange(2**32)
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    sampler, out, state = Sampler(), [], SamplerState("r")
    while not out or out[-1] != tokenizer.eos_token_id:
        logits = torch.randn(1, len(tokenizer), generator=gen) * 5
        out += sampler.sample(logits, [state], [SamplingParams(temperature=1.0, seed=seed, grammar=grammar)])
        assert len(out) <= len(canonical) + 1
    assert tokenizer.decode(out[:-1]) == json.dumps(text)
    assert out[:len(canonical) - 1] == canonical[:-1]
