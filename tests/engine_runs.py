"""Running an engine's requests to the end and comparing what came back: shared by the engine tests and the
weight-dtype tests (a helper module at the tests' root, so each folder's tests can import it)."""
from __future__ import annotations

import random

from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.sampling_params import SamplingParams


def run_to_end(engine: LLMEngine, requests: list[tuple[str, list[int]]], max_tokens=6, after_each_step=None):
    """Submit all requests at once; return request id -> (output ids, per-token top logprobs, last output)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    for rid, prompt in requests:
        engine.add_request(rid, prompt, params)
    results = {rid: ([], [], None) for rid, _ in requests}
    while engine.has_work():
        for out in engine.step():
            ids, lps, _ = results[out.request_id]
            ids.extend(out.new_token_ids)
            lps.extend(out.logprobs or [])
            results[out.request_id] = (ids, lps, out)
        if after_each_step:
            after_each_step(engine)
    return results


def run_one_by_one(engine, requests, **kw):
    merged = {}
    for rid, prompt in requests:
        merged.update(run_to_end(engine, [(rid, prompt)], **kw))
    return merged


def shared_prefix_prompts(rng: random.Random, vocab: int, n: int) -> list[tuple[str, list[int]]]:
    stem = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))]
    out = []
    for i in range(n):
        cut = rng.randrange(0, len(stem) + 1)
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]
        out.append((f"r{i}", stem[:cut] + tail))
    return out


def assert_logprobs_close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) <= 1e-4 * max(1.0, abs(y.logprob))
        for (ta, _, va), (tb, _, vb) in zip(x.top, y.top):
            assert abs(va - vb) <= 1e-4 * max(1.0, abs(vb))
