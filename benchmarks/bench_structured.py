"""Constrained decoding's cost per token, on the bundled SmolLM2 (49,152-token vocabulary).

1. In one process, the grammar libraries alone: replaying the tokens of a JSON document that matches a
   schema, per step the time to fill each row's token bitmask, to apply the batch's mask to the logits
   (structured_output.apply_bitmask_), and to advance each row's matcher; xgrammar, and llguidance when it is
   installed (it is not a dependency: `pip install llguidance` to compare). Also each library's compile time,
   and the sampler's whole grammar step as the server runs it (structured_output.GrammarMatchers: matchers,
   masks, the tokenizer's own tokens for forced text, accepting the token).
2. Over HTTP, the served model: the time per generated token (after the first) of streamed chat answers,
   free text against JSON held to a schema, alternated, one at a time and `--concurrency` at once.
   The JSON schema asks for a fixed number of short strings, so both kinds write a similar number of tokens.

CPU-time figures (part 1) are this thread's own; the HTTP figures are wall time: on a shared machine, compare
the ratios of one run.

    .venv/bin/python -m benchmarks.bench_structured [--repeats 5] [--batch 1,8] [--http-repeats 3] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch

from benchmarks.bench_ttft import served_model, server_process
from reuse_server.model.loader import load_tokenizer, resolve_model
from reuse_server.engine.structured_output import Constraint, GrammarCompiler, GrammarMatchers, apply_bitmask_
from reuse_server.engine.sampler import SamplerState

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
    "units": {"enum": ["metric", "imperial"]},
    "stops": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "hours": {"type": "number"}}, "required": ["name", "hours"]}}},
    "required": ["city", "days", "units", "stops"], "additionalProperties": False}
DOCUMENT = {"city": "Paris, France", "days": 3, "units": "metric", "stops": [
    {"name": "The Louvre museum", "hours": 3.5}, {"name": "Eiffel tower at night", "hours": 1.25},
    {"name": "A small cafe in Montmartre with a view", "hours": 2}]}
WORDS_SCHEMA = {"type": "object", "properties": {"words": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 24, "maxItems": 24}},
    "required": ["words"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "List twenty-four words about the sea."}]


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[eos]), max_threads=1, cache_enabled=False)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def compile(self, schema: str):
        # its JSON compiler, with the same one-line separators as xgrammar's any_whitespace=False
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # compiles lazily: make it do the work now
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def libraries(tokenizer, vocab: int, eos: int) -> list:
    libs = [XGrammar(tokenizer, vocab, eos)]
    try:
        libs.append(LLGuidance(tokenizer, vocab, eos))
    except ImportError:
        emit(kind="library", library="llguidance", skipped="not installed")
    return libs


def replay(lib, grammar, tokens: list[int], batch: int, vocab: int) -> dict:
    """Per step (one token of the document for each of `batch` rows): fill, apply, accept, in CPU seconds."""
    clock = time.thread_time
    matchers = [lib.matcher(grammar) for _ in range(batch)]
    words = (vocab + 31) // 32
    fill = apply = accept = 0.0
    for token in tokens:
        bitmask = torch.empty(batch, words, dtype=torch.int32)
        logits = torch.zeros(batch, vocab)
        t0 = clock()
        for row, m in enumerate(matchers):
            lib.fill(m, bitmask, row)
        t1 = clock()
        apply_bitmask_(logits, bitmask, list(range(batch)))
        t2 = clock()
        for m in matchers:
            assert lib.accept(m, token), (lib.name, token)
        t3 = clock()
        assert logits[0, token] == 0.0, "the document's own token is allowed"
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
    n = len(tokens)
    return dict(fill_us_per_row=us(fill / n / batch), apply_us_per_step=us(apply / n),
                accept_us_per_row=us(accept / n / batch), total_us_per_step=us((fill + apply + accept) / n))


def library_costs(repeats: int, batches: list[int]) -> None:
    torch.set_num_threads(1)  # the figures are this thread's CPU time
    tokenizer = load_tokenizer(resolve_model("bundled"))
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False) + [eos]
    schema = json.dumps(SCHEMA)
    libs = libraries(tokenizer, vocab, eos)
    samples: dict[tuple[str, int], list[dict]] = {}
    compiles: dict[str, list[float]] = {lib.name: [] for lib in libs}
    for _ in range(repeats):
        for lib in libs:  # alternated, so that both see the same machine
            t0 = time.thread_time()
            grammar = lib.compile(schema)
            compiles[lib.name].append(time.thread_time() - t0)
            for batch in batches:
                samples.setdefault((lib.name, batch), []).append(replay(lib, grammar, tokens, batch, vocab))
    for lib in libs:
        emit(kind="compile", library=lib.name, compile_ms_median=round(statistics.median(compiles[lib.name]) * 1e3, 2))
    for (name, batch), rows in samples.items():
        emit(kind="mask", library=name, batch=batch, vocab=vocab, document_tokens=len(tokens), repeats=repeats,
             **{k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]})
    sampler_costs(tokenizer, tokens, repeats, batches)


def sampler_costs(tokenizer, tokens: list[int], repeats: int, batches: list[int]) -> None:
    grammar = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        Constraint("json_schema", json.dumps(SCHEMA), "response_format"))
    for batch in batches:
        steps = []
        for _ in range(repeats):
            matchers, logits = GrammarMatchers(), torch.zeros(batch, len(tokenizer))
            states = [SamplerState(f"r{i}") for i in range(batch)]
            t0 = time.thread_time()
            for token in tokens:
                matchers.mask_(logits, states, [grammar] * batch)
                for state in states:
                    matchers.accept(state, token)
            steps.append((time.thread_time() - t0) / len(tokens))
        emit(kind="sampler", batch=batch, us_per_step=us(statistics.median(steps)),
             us_per_row=us(statistics.median(steps) / batch))


def per_token_seconds(client, model: str, constrained: bool) -> tuple[float, int]:
    """(wall seconds per generated token after the first, tokens) of one streamed answer."""
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "words", "schema": WORDS_SCHEMA}}} \
        if constrained else {"extra_body": {"ignore_eos": True}}
    start = time.perf_counter()
    first = usage = None
    stream = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, stream=True,
                                            max_tokens=PER_TOKEN_MAX, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        usage = chunk.usage or usage
    end = time.perf_counter()
    return (end - first) / max(1, usage.completion_tokens - 1), usage.completion_tokens


PER_TOKEN_MAX = 160


def http_costs(repeats: int, concurrency: int) -> None:
    with server_process("--block-size", "16", "--no-blend-key-shift") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = served_model(url)
        per_token_seconds(client, model, True)  # compiles the grammar (and the tokenizer table) once
        _, json_tokens = per_token_seconds(client, model, True)
        global PER_TOKEN_MAX
        PER_TOKEN_MAX = json_tokens  # free text writes as many tokens as the JSON answer
        for parallel in sorted({1, concurrency}):
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for constrained in (False, True):
                    with ThreadPoolExecutor(parallel) as pool:
                        rows = list(pool.map(lambda _: per_token_seconds(client, model, constrained), range(parallel)))
                    times[constrained] += [t for t, _ in rows]
            free, held = statistics.median(times[False]), statistics.median(times[True])
            emit(kind="http", concurrency=parallel, tokens=json_tokens, repeats=repeats,
                 free_ms_per_token=round(free * 1e3, 2), json_ms_per_token=round(held * 1e3, 2),
                 json_over_free=round(held / free, 3))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", default="1,8", help="rows masked together (comma-separated)")
    ap.add_argument("--http-repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--no-http", action="store_true", help="only the libraries, no server")
    args = ap.parse_args(argv)
    library_costs(args.repeats, [int(b) for b in args.batch.split(",")])
    if not args.no_http:
        http_costs(args.http_repeats, args.concurrency)


if __name__ == "__main__":
    main()
