"""API keys and tenants, over HTTP against a real server started with keys (one on the command line, one in a
key file) and an admin key: requests without a valid key get 401; each key is its own cache namespace for
prefix hits, blended chunks and POST /v1/cache/chunks (a cache_salt narrows it further, never widens it);
/metrics needs the admin key. In the engine, prefill dedup never makes one tenant's request wait for another
tenant's block (that wait would tell it the other tenant is sending the same prompt), and each tenant
tokenizes through its own token cache."""
import uuid

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from blend.chunking import encode
from blend.token_cache import cache_for
from reuse_server.api.api_keys import key_digest
from reuse_server.api.tokenizing import Tokenizing
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from server_process import running_server
from test_api_blend import MIN_TOKENS, chat, details, passages, rag_messages
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

MODEL = "tiny"
ALPHA, BETA, ADMIN = "key-alpha", "key-beta-from-file", "ops-key"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """4 layers, as in test_api_blend: with 2 the check layer is the last and blending would be exact."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-4-layers"), arch="llama", num_layers=4)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    key_file = folder / "keys.txt"
    key_file.write_text(f"# tenants\n\n  {BETA}  \n")
    with running_server(checkpoint, folder / "server.log", "--block-size", "4", "--num-gpu-blocks", "1024",
                        "--max-model-len", "512", "--blend", "--blend-min-tokens", str(MIN_TOKENS),
                        "--blend-max-deviation", "inf",  # a random checkpoint's deviations mean nothing
                        "--api-key", ALPHA, "--api-key-file", str(key_file), "--admin-api-key", ADMIN) as url:
        yield url


def client(server: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=key, max_retries=0, timeout=60)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), bearer(ADMIN), {"Authorization": f"Basic {ALPHA}"},
                                     {"Authorization": ALPHA}], ids=["none", "wrong", "admin", "basic", "bare"])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/cache/chunks", {"chunks": ["a document"]}),
    ("/v1/models", None)])
def test_no_valid_key_gets_401(server, headers, path, body):
    r = httpx.post(server + path, json=body, headers=headers) if body else httpx.get(server + path, headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"


def test_valid_keys_are_served_and_open_routes_stay_open(server):
    for key in (ALPHA, BETA):
        assert [m.id for m in client(server, key).models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        client(server, "nope").models.list()
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert httpx.get(server + "/openapi.json").status_code == 200


def test_metrics_need_the_admin_key(server):
    for headers in ({}, bearer(ALPHA)):
        r = httpx.get(server + "/metrics", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server + "/metrics", headers=bearer(ADMIN))
    assert r.status_code == 200 and "kvreuse_kv_blocks" in r.text


def cached(server: str, key: str, prompt: str, **extra) -> int:
    resp = client(server, key).completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
    return resp.usage.prompt_tokens_details.cached_tokens


def test_each_key_is_its_own_prefix_cache_namespace(server):
    prompt = f"[{uuid.uuid4().hex}] " + "The quick brown fox jumps over the lazy dog. " * 6
    assert cached(server, ALPHA, prompt) == 0
    hit = cached(server, ALPHA, prompt)
    assert hit > 0  # the tenant's own prompt hits...
    assert cached(server, BETA, prompt) == 0  # ...another tenant's never does
    assert cached(server, BETA, prompt) == hit  # (it has its own copy now)
    assert cached(server, ALPHA, prompt, cache_salt="s") == 0  # a salt narrows a tenant's namespace
    assert cached(server, ALPHA, prompt, cache_salt="s") == hit
    assert cached(server, BETA, prompt, cache_salt="s") == 0  # and the same salt does not join tenants


def precompute(server: str, key: str, docs: list[str]) -> dict:
    r = httpx.post(server + "/v1/cache/chunks", json={"model": MODEL, "chunks": docs}, headers=bearer(key),
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_precomputed_and_blended_chunks_stay_with_their_tenant(server, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    docs = passages()
    sizes = [len(encode(tokenizer, d)) for d in docs]
    assert precompute(server, ALPHA, docs)["stored_tokens"] == sum(sizes)
    messages = rag_messages(docs[::-1])  # an order never seen: only blending can reuse the documents
    blend = {"kv_blend": {"recompute_ratio": 0.0}}
    beta_view = chat(client(server, BETA), messages, **blend)
    assert details(beta_view)[:2] == (0, 0)
    assert details(chat(client(server, ALPHA), messages, prefix_cache=False, **blend))[1] == sum(sizes)
    # precomputing what another tenant precomputed finds nothing of theirs
    others = passages()
    assert precompute(server, ALPHA, others)["stored_tokens"] > 0
    again = precompute(server, BETA, others)
    assert not any(c["already_cached"] for c in again["chunks"]) and again["stored_tokens"] > 0
    assert all(c["already_cached"] for c in precompute(server, ALPHA, others)["chunks"])


def test_prefill_dedup_never_waits_on_another_tenant(tiny_llama_path):
    """A request whose next block another request is computing waits a step to hit it: only within a tenant."""
    engine = build_engine(EngineConfig(model=str(tiny_llama_path), block_size=4, num_gpu_blocks=256,
                                    max_num_batched_tokens=256))
    alpha, beta = key_digest(ALPHA), key_digest(BETA)

    def first_step(second_tenant: str, offset: int) -> int:
        """Tokens the second of two identical prompts computed in the step that admitted the first."""
        prompt = [3 + (offset + i) % 300 for i in range(40)]
        for rid, tenant in (("first", alpha), ("second", second_tenant)):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=1), CacheOptions(tenant=tenant))
        engine.step()
        computed = engine.seqs["second"].num_computed if "second" in engine.seqs else len(prompt)
        while engine.has_work():
            engine.step()
        return computed

    assert first_step(alpha, 0) == 0  # same tenant: it waits for the first one's blocks
    assert first_step(beta, 100) > 0  # another tenant: computed at once, in its own namespace


def test_each_tenant_tokenizes_through_its_own_token_cache(tiny_llama_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    tokenizing = Tokenizing(tokenizer, tenant_views=2)
    try:
        a, b = tokenizing.tokenizer_for("a"), tokenizing.tokenizer_for("b")
        assert tokenizing.tokenizer_for(None) is tokenizer and tokenizing.tokenizer_for("a") is a
        text = "The quick brown fox jumps over the lazy dog. " * 30  # long enough to be cached
        assert encode(a, text) == encode(b, text) == encode(tokenizer, text)
        assert len({id(cache_for(t)) for t in (tokenizer, a, b)}) == 3
        assert cache_for(a).stats.misses == 1 and cache_for(b).stats.misses == 1  # b did not hit a's entry
        assert a.chat_template == tokenizer.chat_template
        tokenizing.tokenizer_for("c")  # beyond the bound: the least recent view (b) is dropped
        assert tokenizing.tokenizer_for("a") is a and tokenizing.tokenizer_for("b") is not b
    finally:
        tokenizing.close()
