"""What one tenant can learn of another through the cache routes, over HTTP against an in-process server
started with two tenant keys (with and without an admin key): GET /v1/cache/stats shows a tenant key only its
own prompt-cache pins (how many, how large, when they expire, how many gave way) beside the whole-server figures
everyone sees, the admin key every tenant's, and no key nothing; POST /v1/cache/prefetch finds only the
tenant's own cached prefix. (Stored responses and precomputed chunks have their tenant tests beside their
routes: test_api_responses.py, test_api_tenants.py.)"""
from __future__ import annotations

import random

import anthropic
import httpx
import openai
import pytest

from inprocess_server import serving
from reuse_server.api.api_keys import ApiKeys, key_digest
from reuse_server.api.settings import ServerSettings
from reuse_server.engine.async_engine import AsyncEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig

pytestmark = pytest.mark.server

MODEL = "tiny"
ALPHA, BETA, ADMIN = "iso-alpha", "iso-beta", "iso-admin"
SEED = 20261205
WORDS = "cache block prefix pin reuse token model server paris weather query answer radix tree".split()
BLOCK_SIZE, NUM_BLOCKS, PINNED_SHARE = 4, 256, 0.125  # a tenant's pins may hold 32 blocks (128 tokens)


def text(n: int, salt: int) -> str:
    rng = random.Random(SEED + salt)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(params=[True, False], ids=["admin-key", "no-admin-key"])
def served(request, tiny_llama_path):
    """A fresh server (no pins from another test), with or without an admin key beside the tenant keys."""
    print(f"seed {SEED}")
    admin = request.param
    settings = ServerSettings(api_keys=ApiKeys([ALPHA, BETA], [ADMIN] if admin else []))
    engine = AsyncEngine.launch(lambda: build_engine(EngineConfig(
        model=str(tiny_llama_path), served_model_name=MODEL, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
        max_model_len=1024, max_pinned_share=PINNED_SHARE)))
    with serving(engine, settings) as url:
        yield url, admin


def pin(url: str, key: str, system: str, question: str | None = None) -> None:
    """One Messages request (x-api-key, as the anthropic SDK sends it) whose system prompt, and question if
    given, are cache_control breakpoints."""
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)
    mark = {"type": "ephemeral"}
    content = [{"type": "text", "text": question or "hi", **({"cache_control": mark} if question else {})}]
    claude.messages.create(model=MODEL, max_tokens=1, system=[{"type": "text", "text": system, "cache_control": mark}],
                           messages=[{"role": "user", "content": content}])


def stats(url: str, headers: dict) -> httpx.Response:
    return httpx.get(url + "/v1/cache/stats", headers=headers, timeout=30)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_key_sees_only_its_own_pins(served):
    url, admin = served
    alpha, beta = key_digest(ALPHA), key_digest(BETA)
    pin(url, ALPHA, text(6, 1))
    pin(url, BETA, text(6, 2), text(4, 3))

    alpha_view = stats(url, bearer(ALPHA))
    beta_view = stats(url, {"x-api-key": BETA})  # Anthropic's header is a tenant key here too
    assert alpha_view.status_code == beta_view.status_code == 200
    assert beta not in alpha_view.text and alpha not in beta_view.text  # not even that the other exists
    mine, theirs = alpha_view.json()["pins"], beta_view.json()["pins"]
    assert list(mine["tenants"]) == [alpha] and mine["pins"] == mine["tenants"][alpha]["pins"] == 1
    assert list(theirs["tenants"]) == [beta] and theirs["pins"] == theirs["tenants"][beta]["pins"] == 2
    for view in (mine, theirs):
        (own,) = view["tenants"].values()
        assert view["pinned_blocks"] == own["pinned_blocks"] > 0 and view["given_way"] == own["given_way"] == 0
        assert view["pinned_tokens"] == own["pinned_tokens"] == own["pinned_blocks"] * BLOCK_SIZE
        assert view["budget_blocks_per_tenant"] == int(PINNED_SHARE * NUM_BLOCKS)
    # the whole server's figures are everyone's
    a, b = alpha_view.json(), beta_view.json()
    assert a["device"]["total_blocks"] == NUM_BLOCKS and a["sizing"] == b["sizing"] and a["tiers"] == b["tiers"]

    for headers in ({}, bearer("wrong"), {"x-api-key": "wrong"}, *(() if admin else (bearer(ADMIN),))):
        r = stats(url, headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
    if admin:  # the operator sees every tenant, and the totals over them
        whole = stats(url, bearer(ADMIN)).json()["pins"]
        assert set(whole["tenants"]) == {alpha, beta} and whole["pins"] == 3
        assert whole["pinned_blocks"] == mine["pinned_blocks"] + theirs["pinned_blocks"]
        assert whole["tenants"][alpha]["pinned_blocks"] == mine["pinned_blocks"]


def test_each_tenant_is_shown_only_its_own_pins_given_way(served):
    """Past its share of the pool a tenant's least recently used pin gives way: that tenant is told, another
    is not (the count would say how hard someone else is pinning)."""
    url, admin = served
    alpha, beta = key_digest(ALPHA), key_digest(BETA)
    pin(url, ALPHA, text(6, 4))
    first, second = text(20, 5), text(20, 6)  # about 24 blocks each: both do not fit a budget of 32
    pin(url, BETA, first)
    pin(url, BETA, second)

    theirs = stats(url, bearer(BETA)).json()["pins"]
    assert theirs["given_way"] == theirs["tenants"][beta]["given_way"] == 1 and theirs["pins"] == 1
    mine = stats(url, bearer(ALPHA)).json()["pins"]
    assert mine["given_way"] == mine["tenants"][alpha]["given_way"] == 0 and mine["pins"] == 1
    if admin:
        whole = stats(url, bearer(ADMIN)).json()["pins"]
        assert whole["given_way"] == 1 and whole["tenants"][alpha]["given_way"] == 0


def test_prefetch_finds_only_the_tenants_own_prefix(served):
    url, _ = served
    prompt = text(30, 7)

    def resident(key: str) -> int:
        r = httpx.post(url + "/v1/cache/prefetch", json={"model": MODEL, "prompt": prompt}, headers=bearer(key),
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["resident_tokens"]

    openai.OpenAI(base_url=url + "/v1", api_key=ALPHA, max_retries=0, timeout=60).completions.create(
        model=MODEL, prompt=prompt, max_tokens=1)
    assert resident(BETA) == 0  # another tenant's cached prompt is not there for it
    assert resident(ALPHA) >= len(prompt.split())  # the tenant's own is (at least a token a word)
