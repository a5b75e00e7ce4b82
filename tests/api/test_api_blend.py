"""Blending over HTTP: the real server (tiny random checkpoint, `--blend`) driven by the openai client and httpx.
Documents precomputed with POST /v1/cache/chunks are blended into chat and separator-split completion prompts
wherever they appear; usage and /metrics report what was reused; bad input is a 400 that holds no KV block."""
import itertools
import uuid

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from blend.chunking import encode, render_chat_chunks
from reuse_server.api.chat_template import PART_SEPARATOR, user_turn_opening
from server_process import metric, running_server, scrape, wait_idle
from test_api_server import MODEL
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BLOCK_SIZE = 4
MIN_TOKENS = 8
MAX_MODEL_LEN = 512
SEP = "|||"
QUESTION = "Why?"  # shorter than MIN_TOKENS: never a reusable chunk of its own


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """4 layers: with 2, the check layer (1) is the last and is always computed in full, so blending would
    be exact and a comparison with a full prefill could not tell a blended answer from a recomputed one."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-4-layers"), arch="llama", num_layers=4)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("blend-server") / "server.log"
    # the fidelity check off: a random checkpoint's deviations say nothing of its text, and these tests count
    # exactly what is blended (the check's own tests: tests/engine/test_engine_blend_fidelity.py)
    with running_server(checkpoint, log_path, "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", "512",
                        "--max-model-len", str(MAX_MODEL_LEN), "--blend", "--blend-min-tokens", str(MIN_TOKENS),
                        "--blend-separator", SEP, "--blend-max-deviation", "inf") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


_TAG_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
_tag_count = itertools.count()


def passages() -> list[str]:
    """Three documents no other request has sent. Each starts with its own tag, whose first letter differs
    from every other document's of the last few calls: documents that share even their first token would
    partly match each other in the chunk index and, since reuse is to the token, in the prefix cache."""
    texts = ["A paged KV cache stores keys and values in fixed-size blocks.\n",
             "Retrieval augmented generation puts documents into the prompt.\n",
             "The capital of France is Paris; the quick brown fox is lazy.\n"]
    return [f"{_TAG_LETTERS[next(_tag_count) % len(_TAG_LETTERS)]}{uuid.uuid4().hex[:8]}: {text}" for text in texts]


def precompute(server: str, chunks: list[str], **extra) -> dict:
    r = httpx.post(server + "/v1/cache/chunks", json={"model": MODEL, "chunks": chunks, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def rag_messages(docs: list[str]) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": d} for d in docs] + [
        {"type": "text", "text": QUESTION}]}]


def chat(client, messages, **extra_body):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True, **extra_body})


def logprobs(resp) -> list[float]:
    return [t.logprob for t in resp.choices[0].logprobs.content]


def details(resp) -> tuple[int, int, int]:
    d = resp.usage.prompt_tokens_details
    return d.cached_tokens, d.blended_tokens, d.recomputed_tokens


# ---------------------------------------------------------------- precompute, then blend


def test_precomputed_documents_are_blended_into_a_chat_prompt(server, client, tokenizer):
    docs = passages()
    sizes = [len(encode(tokenizer, d)) for d in docs]
    assert min(sizes) >= MIN_TOKENS and len(encode(tokenizer, QUESTION)) < MIN_TOKENS
    before = wait_idle(server)

    first = precompute(server, docs + ["hi"])
    assert first["object"] == "cache.chunks" and first["model"] == MODEL
    assert [c["tokens"] for c in first["chunks"]] == sizes + [len(encode(tokenizer, "hi"))]
    assert [c["stored_tokens"] for c in first["chunks"]] == sizes + [0]
    assert first["stored_tokens"] == sum(sizes)
    assert not any(c["already_cached"] for c in first["chunks"])
    assert first["chunks"][3]["skipped"] == f"shorter than {MIN_TOKENS} tokens"
    assert all("skipped" not in c for c in first["chunks"][:3])
    again = precompute(server, docs)
    assert again["stored_tokens"] == 0
    assert [(c["already_cached"], c["stored_tokens"]) for c in again["chunks"]] == [(True, 0)] * 3

    messages = rag_messages([docs[2], docs[0], docs[1]])  # an order the server has never seen
    blended = chat(client, messages, kv_blend={"enabled": True, "recompute_ratio": 0.0})
    cached, n_blended, n_recomputed = details(blended)
    # Documents are precomputed after the chat template's opening, which also put "opening + document" in the
    # exact prefix cache: the first document comes (in full blocks) as a prefix hit, every other document token
    # is blended; ratio 0 recomputes none of them.
    opening = user_turn_opening(tokenizer)
    assert cached == len(opening) + sum(sizes) and n_recomputed == 0
    assert sizes[0] + sizes[1] <= n_blended <= sum(sizes)
    chunks = render_chat_chunks(tokenizer, messages, part_separator=PART_SEPARATOR)
    assert blended.usage.prompt_tokens == sum(len(encode(tokenizer, c.text)) for c in chunks)

    # ratio 1: the same documents are found but all recomputed, which is exactly a full prefill.
    # prefix_cache off, or the ratio-0 prompt (now in the prefix cache) would be an exact prefix hit.
    full_recompute = chat(client, messages, kv_blend={"enabled": True, "recompute_ratio": 1.0}, prefix_cache=False)
    reference = chat(client, messages, kv_blend={"enabled": False}, prefix_cache=False)
    assert details(full_recompute) == (0, 0, sum(sizes))
    assert details(reference) == (0, 0, 0)
    assert full_recompute.choices[0].message.content == reference.choices[0].message.content
    assert logprobs(full_recompute) == pytest.approx(logprobs(reference), abs=1e-4)
    # ...while reusing the documents' KV as is does change them (so the comparison above has teeth)
    assert logprobs(blended) != pytest.approx(logprobs(reference), abs=1e-3)
    # blending on or off, the model sees the same prompt tokens
    assert full_recompute.usage.prompt_tokens == reference.usage.prompt_tokens == blended.usage.prompt_tokens

    # the blended prompt went into the prefix cache: the same request again is an exact prefix hit
    repeat = chat(client, messages, kv_blend={"enabled": True, "recompute_ratio": 0.0})
    n = repeat.usage.prompt_tokens
    assert details(repeat) == (n - 1, 0, 0)  # all but the last token, whose logits start the answer
    assert details(repeat)[0] > cached

    after = wait_idle(server)
    assert metric(after, "kvreuse_kv_blocks", state="in_use") == 0
    usages = [blended, full_recompute, reference, repeat]

    def delta(name):
        return metric(after, name) - metric(before, name)

    assert delta("kvreuse_blended_tokens_total") == sum(details(u)[1] for u in usages) == n_blended
    assert delta("kvreuse_recomputed_tokens_total") == sum(details(u)[2] for u in usages) == sum(sizes)


def test_server_default_blends_and_ordinary_traffic_fills_the_index(server, client, tokenizer):
    """--blend: a request that does not mention kv_blend blends, and its documents become reusable."""
    docs = passages()[:2]
    first = chat(client, rag_messages(docs))
    assert details(first)[1:] == (0, 0)  # nothing to blend yet
    swapped = chat(client, rag_messages(docs[::-1]), kv_blend={"recompute_ratio": 0.0})
    assert details(swapped)[1] == sum(len(encode(tokenizer, d)) for d in docs)
    # a request that does not blend does not file its documents either
    unfiled = passages()[:2]
    chat(client, rag_messages(unfiled), kv_blend={"enabled": False})
    later = chat(client, rag_messages(unfiled[::-1]), kv_blend={"recompute_ratio": 0.0})
    assert details(later)[1] == 0


def test_tool_outputs_are_chunks_blending_reuses_when_an_agent_reorders_them(server, client, tokenizer):
    """An agent step with two parallel calls sends their outputs back in another order the next time: the
    prefix ends at the first output, and both outputs are blended from where they were before."""
    outputs = passages()[:2]
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"i": {i}}}'}}
             for i in range(2)]
    def step(order):
        messages = [{"role": "user", "content": "Look both up."}, {"role": "assistant", "tool_calls": calls}]
        messages += [{"role": "tool", "tool_call_id": f"call_{i}", "content": outputs[i]} for i in order]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                              extra_body={"kv_blend": {"recompute_ratio": 0.0}})

    assert details(step([0, 1]))[1] == 0  # nothing to blend yet; the outputs are filed as chunks
    reordered = step([1, 0])
    assert details(reordered)[1] >= sum(len(encode(tokenizer, o)) for o in outputs)


def test_cache_salt_separates_precomputed_documents(server, client, tokenizer):
    docs = passages()
    precompute(server, docs, cache_salt="tenant-a")
    messages = rag_messages(docs[::-1])
    assert details(chat(client, messages, kv_blend={"recompute_ratio": 0.0}))[1] == 0
    salted = chat(client, messages, kv_blend={"recompute_ratio": 0.0}, cache_salt="tenant-a", prefix_cache=False)
    assert details(salted)[1] == sum(len(encode(tokenizer, d)) for d in docs)


def test_separator_split_completion_blends_precomputed_pieces(server, client, tokenizer):
    docs = passages()
    precompute(server, docs[:2])
    # (a prompt that started with a precomputed piece would find most of it in the prefix cache instead)
    pieces = [f"{uuid.uuid4().hex[:8]}: use these documents.\n", docs[1], docs[2], docs[0], "Q: why?"]
    resp = client.completions.create(model=MODEL, prompt=SEP.join(pieces), max_tokens=2, temperature=0,
                                     extra_body={"kv_blend": {"recompute_ratio": 0.0}, "ignore_eos": True})
    assert resp.usage.prompt_tokens == sum(len(encode(tokenizer, p)) for p in pieces)  # separator removed
    expected = len(encode(tokenizer, docs[0])) + len(encode(tokenizer, docs[1]))
    assert details(resp) == (expected, expected, 0)
    # token-id prompts have no chunks: nothing to blend
    ids = [t for p in pieces for t in encode(tokenizer, p)]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                       extra_body={"prefix_cache": False, "kv_blend": {"recompute_ratio": 0.0}})
    assert details(by_ids) == (0, 0, 0)


# ---------------------------------------------------------------- bad input


def _long_parts(n: int) -> list[dict]:
    return [{"type": "text", "text": "The quick brown fox jumps over the lazy dog. " * 3}] * n


ERROR_CASES = [
    # (id, path, body, status, param, words in the message)
    ("ratio-above-1", "/v1/chat/completions",
     {"messages": rag_messages(["doc"]), "kv_blend": {"enabled": True, "recompute_ratio": 1.5}}, 400,
     "kv_blend.recompute_ratio", ["kv_blend.recompute_ratio"]),
    ("ratio-below-0", "/v1/completions", {"prompt": "x", "kv_blend": {"recompute_ratio": -0.1}}, 400,
     "kv_blend.recompute_ratio", ["kv_blend.recompute_ratio"]),
    ("kv-blend-unknown-field", "/v1/chat/completions",
     {"messages": rag_messages(["doc"]), "kv_blend": {"enabled": True, "ratio": 0.2}}, 400, "kv_blend.ratio",
     ["kv_blend.ratio"]),
    ("empty-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}]},
     400, "messages[0].content", ["non-empty"]),
    ("parts-too-long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": _long_parts(12)}], "kv_blend": {"enabled": True}}, 400, None,
     [str(MAX_MODEL_LEN), "However"]),
    ("separator-pieces-too-long", "/v1/completions",
     {"prompt": SEP.join(["The quick brown fox jumps over the lazy dog. " * 3] * 12)}, 400, None,
     [str(MAX_MODEL_LEN)]),
    ("chunks-unknown-field", "/v1/cache/chunks", {"chunks": ["abc"], "max_tokens": 3}, 400, "max_tokens",
     ["max_tokens"]),
    ("chunks-empty-list", "/v1/cache/chunks", {"chunks": []}, 400, "chunks", ["chunks"]),
    ("chunks-missing", "/v1/cache/chunks", {"cache_salt": "x"}, 400, "chunks", ["chunks"]),
    ("chunks-empty-text", "/v1/cache/chunks", {"chunks": ["abc", ""]}, 400, "chunks[1]", ["chunks[1]"]),
    ("chunks-not-text", "/v1/cache/chunks", {"chunks": ["abc", 7]}, 400, "chunks[1]", ["chunks[1]"]),
    ("chunks-too-many", "/v1/cache/chunks", {"chunks": ["abc"] * 257}, 400, "chunks", ["256"]),
    ("chunks-too-long", "/v1/cache/chunks",
     {"chunks": ["Paris is lovely in spring.", "The quick brown fox jumps over the lazy dog. " * 40]}, 400,
     "chunks[1]", [str(MAX_MODEL_LEN), "1160 tokens", "at most"]),
    ("chunks-wrong-model", "/v1/cache/chunks", {"model": "gpt-4", "chunks": ["abc"]}, 404, "model", ["gpt-4"]),
]


@pytest.fixture(scope="module")
def metrics_before_errors(server):
    return wait_idle(server)


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_input_is_rejected(server, metrics_before_errors, case):
    _, path, body, status, param, words = case
    r = httpx.post(server + path, json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]


def test_too_long_chat_error_counts_the_chunked_prompt(server, tokenizer):
    messages = [{"role": "user", "content": _long_parts(12)}]
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
    chunks = render_chat_chunks(tokenizer, messages, part_separator=PART_SEPARATOR)
    n = sum(len(encode(tokenizer, c.text)) for c in chunks)
    assert r.status_code == 400 and f"your prompt has {n} tokens" in r.json()["error"]["message"]


def test_rejected_requests_hold_no_kv_block_and_did_no_work(server, metrics_before_errors):
    after = wait_idle(server)
    assert metric(after, "kvreuse_kv_blocks", state="in_use") == 0
    for name in ("kvreuse_prompt_tokens_total", "kvreuse_blended_tokens_total",
                 "kvreuse_e2e_request_latency_seconds_count"):
        assert metric(after, name) == metric(metrics_before_errors, name), name
    assert scrape(server)  # still serving


def test_cache_stats_and_metrics_report_blending_and_its_fidelity_check(server):
    """The blend section of /v1/cache/stats and the Prometheus counters beside the blend ones; this server runs
    with the check off (null threshold), so nothing is rejected."""
    stats = httpx.get(server + "/v1/cache/stats", timeout=30).json()["blend"]
    assert stats["max_deviation"] is None and stats["rejected_chunks"] == stats["rejected_tokens"] == 0
    m = scrape(server)
    assert metric(m, "kvreuse_blend_rejected_chunks_total") == metric(m, "kvreuse_blend_rejected_tokens_total") == 0
    assert stats["blended_tokens"] == metric(m, "kvreuse_blended_tokens_total")
