"""A flood before the queue (a real server around a real engine): requests still being tokenized count
against --max-waiting before they are tokenized, so a flood of 100,000-character prompts is refused with 429
and Retry-After without tokenizing any of them, and the memory the flood leaves held is the few admitted
prompts', not the flood's. The tokenizer is the engine's own, behind a gate that holds the admitted requests
on the tokenizing threads (so that what is admitted does not depend on the machine's speed) and counts calls."""
import asyncio
import gc
import threading
import time
import tracemalloc

import httpx
import pytest

from inprocess_server import serving
from reuse_server.engine.async_engine import AsyncEngine
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig

pytestmark = pytest.mark.server  # starts a server

MODEL = "tiny"
MAX_WAITING = 2  # the default tokenizing threads (2) can each hold one admitted request
FLOOD = 100
PROMPT_CHARS = 100_000
SAFETY = 120  # seconds: a deadline for a slow machine, never what the test measures


class GatedTokenizer:
    """The engine's tokenizer; `encode` counts its calls and waits for `gate` first."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.gate = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()

    def encode(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
        assert self.gate.wait(SAFETY)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _settled_growth(before: int, bound: int) -> int:
    """Traced memory grown since `before`, once it has settled under `bound` (garbage collected, the server's
    closing connections let go) or at the deadline; the caller asserts on what it returns."""
    deadline = time.monotonic() + SAFETY
    while True:
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        if held < bound or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + SAFETY
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.02)


@pytest.fixture
def gated_server(tiny_llama_path):
    gated = {}

    def build():
        engine = build_engine(EngineConfig(model=str(tiny_llama_path), served_model_name=MODEL, block_size=4,
                                           num_gpu_blocks=2048))
        engine.tokenizer = gated["tokenizer"] = GatedTokenizer(engine.tokenizer)
        return engine

    engine = AsyncEngine.launch(build, max_waiting=MAX_WAITING)
    try:
        with serving(engine) as url:
            yield url, gated["tokenizer"]
    finally:
        gated["tokenizer"].gate.set()


async def _flood(url: str, prompt: str) -> list[tuple[int, str | None, str | None]]:
    """(status, Retry-After, error code) of FLOOD concurrent requests; the responses (which keep the bodies
    sent) are not kept."""
    limits = httpx.Limits(max_connections=FLOOD, max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient):
        r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        return r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"] if r.is_error else None

    async with httpx.AsyncClient(timeout=SAFETY, limits=limits) as client:
        return await asyncio.gather(*[one(client) for _ in range(FLOOD)])


def test_a_flood_of_huge_prompts_is_refused_before_tokenizing(gated_server):
    url, tokenizer = gated_server
    prompt = "The quick brown fox jumps over the lazy dog. " * (PROMPT_CHARS // 45)
    admitted: list[httpx.Response] = []
    senders = [threading.Thread(target=lambda: admitted.append(
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                   timeout=SAFETY))) for _ in range(MAX_WAITING)]
    for sender in senders:
        sender.start()
    _wait_for(lambda: tokenizer.calls == MAX_WAITING, "the admitted requests on the tokenizing threads")

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        flood = asyncio.run(_flood(url, prompt))
        held = _settled_growth(before, bound=FLOOD * len(prompt) // 10)
    finally:
        tracemalloc.stop()
    assert flood == [(429, "1", "queue_full")] * FLOOD, sorted(set(flood))
    assert tokenizer.calls == MAX_WAITING  # not one of the flood was tokenized
    print(f"{FLOOD} prompts of {len(prompt):,} characters refused; {held / 2**20:.1f} MiB held afterwards")
    # The flood sent FLOOD * len(prompt) bytes (~10 MB): what stays held is a tenth of that at most, so no
    # refused body is kept. Not tighter: the server's connections close on its own loop after the client has
    # its answers, and on a busy machine a few of their read buffers were still alive (1.1 MiB seen).
    assert held < FLOOD * len(prompt) // 10

    tokenizer.gate.set()  # the admitted ones go on: tokenized, then judged as any request is
    for sender in senders:
        sender.join(SAFETY)
    assert len(admitted) == MAX_WAITING and all(r.status_code != 429 for r in admitted)
    assert tokenizer.calls == MAX_WAITING
    short = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
                       timeout=SAFETY)
    assert short.status_code == 200 and tokenizer.calls == MAX_WAITING + 1
