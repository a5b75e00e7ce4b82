"""Sends one workload request with the official `openai` async client, streaming, and times it.

TTFT is the time until the first chunk that carries generated text; the usage (with the server's
cache counters) comes in the last chunk thanks to `stream_options={"include_usage": True}`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai

from loadgen.errors import UsageError
from loadgen.http_recorder import recording_transport
from loadgen.results import RequestResult, apply_usage
from loadgen.workloads.spec import RequestSpec, Session


def normalize_server_url(url: str) -> str:
    """`http://host:port[/v1][/]` -> `http://host:port`."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"server URL must start with http:// or https://, got {url!r}")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: int | None  # when the server says (vLLM-style field)


def discover_model(server: str, timeout: float = 10.0) -> ServedModel:
    """The first model /v1/models lists; an unreachable server is a usage error, not a traceback."""
    try:
        resp = httpx.get(f"{server}/v1/models", timeout=timeout)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach the server at {server} ({type(exc).__name__}: {exc or 'no response'})") from None
    if resp.status_code != 200:
        raise UsageError(f"{server}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        first = resp.json()["data"][0]
        limit = first.get("max_model_len")
        return ServedModel(id=str(first["id"]), max_model_len=int(limit) if isinstance(limit, int) else None)
    except (ValueError, KeyError, IndexError, TypeError):
        raise UsageError(f"{server}/v1/models did not list any model") from None


@dataclass(frozen=True)
class CacheMode:
    """What the request body asks of the server's caches."""

    prefix_cache: bool = True
    kv_blend: bool | None = None  # None: leave it to the server
    recompute_ratio: float | None = None
    cache_salt: str | None = None

    def extra_body(self) -> dict:
        """For the scripted workloads, whose answers are only timed: each generates all its max_tokens."""
        return {"ignore_eos": True, **self.cache_body()}

    def cache_body(self) -> dict:
        body: dict = {}
        if not self.prefix_cache:
            body["prefix_cache"] = False
        if self.kv_blend is not None:
            blend: dict = {"enabled": self.kv_blend}
            if self.kv_blend and self.recompute_ratio is not None:
                blend["recompute_ratio"] = self.recompute_ratio
            body["kv_blend"] = blend
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        return body


BASELINE = CacheMode(prefix_cache=False, kv_blend=False)


def _chunk_has_text(chunk, chat: bool) -> bool:
    for choice in chunk.choices or ():
        text = choice.delta.content if chat else choice.text
        if text:
            return True
    return False


class LoadClient:
    def __init__(self, server: str, model: str, mode: CacheMode, timeout_s: float, seed: int = 0):
        self.server = server
        self.model = model
        self.mode = mode
        self.seed = seed
        self.timeout_s = timeout_s
        self._client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="loadgen", max_retries=0,
                                          timeout=timeout_s,
                                          http_client=httpx.AsyncClient(timeout=timeout_s,
                                                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)))

    async def close(self) -> None:
        await self._client.close()

    async def send(self, spec: RequestSpec, phase_start: float) -> RequestResult:
        sent = time.perf_counter()
        result = RequestResult(session=spec.session, turn=spec.turn, ok=False, start_s=sent - phase_start)
        common = dict(model=self.model, max_tokens=spec.max_tokens, temperature=0.0, seed=self.seed, stream=True,
                      stream_options={"include_usage": True}, extra_body=self.mode.extra_body())
        usage = None
        first_chunk = None
        try:
            if spec.is_chat:
                stream = await self._client.chat.completions.create(messages=list(spec.messages), **common)
            else:
                stream = await self._client.completions.create(prompt=list(spec.prompt_token_ids), **common)
            async for chunk in stream:
                now = time.perf_counter()
                if first_chunk is None and chunk.choices:
                    first_chunk = now
                if result.ttft_s is None and _chunk_has_text(chunk, spec.is_chat):
                    result.ttft_s = now - sent
                if chunk.usage is not None:
                    usage = chunk.usage
        except openai.APIStatusError as exc:
            result.error = f"HTTP {exc.status_code}: {_message(exc)}"
        except (openai.APIError, httpx.HTTPError) as exc:  # connection errors, timeouts, a stream cut short
            result.error = f"{type(exc).__name__}: {exc}"
        result.e2e_s = time.perf_counter() - sent
        if result.error is None:
            if usage is None:
                result.error = "the stream ended without a usage chunk"
            else:
                apply_usage(result, usage)
                result.ok = True
                if result.ttft_s is None and first_chunk is not None:  # only empty-text tokens came back
                    result.ttft_s = first_chunk - sent
        return result


    async def drive(self, session: Session, phase_start: float, deadline: float) -> tuple[list[RequestResult], int]:
        """Run a session whose requests a program decides (session.driver) with an SDK client of its own
        (session.client), each of its generation requests measured on the way (http_recorder). Returns the results and how many of
        the planned requests were not sent."""
        results: list[RequestResult] = []
        if session.client == "anthropic":  # the anthropic SDK 2.x is built on httpx2, and takes only its clients
            import anthropic
            import httpx2 as h
        else:
            h = httpx
        transport = recording_transport(h)(h.AsyncHTTPTransport(), session.id, phase_start, deadline, results)
        async with h.AsyncClient(transport=transport, timeout=self.timeout_s, base_url=self.server) as http:
            if session.client == "http":  # the driver sends its requests as they were recorded
                client = http
            elif session.client == "anthropic":
                client = anthropic.AsyncAnthropic(base_url=self.server, api_key="loadgen", max_retries=0,
                                                  timeout=self.timeout_s, http_client=http)
            else:
                client = openai.AsyncOpenAI(base_url=f"{self.server}/v1", api_key="loadgen", max_retries=0,
                                            timeout=self.timeout_s, http_client=http)
            try:
                await session.driver(client, self.model, self.mode.cache_body())
            except Exception as exc:  # noqa: BLE001 - whatever stopped the program is the session's outcome
                if not transport.refused and (not results or results[-1].error is None):
                    failed = results[-1] if results and results[-1].ok else None
                    message = f"{type(exc).__name__}: {exc}"[:300]
                    if failed is None:
                        results.append(RequestResult(session=session.id, turn=len(results), ok=False,
                                                     start_s=time.perf_counter() - phase_start, error=message))
                    else:  # the answer came back but the program could not use it (e.g. a malformed call)
                        failed.ok, failed.error = False, message
        return results, max(0, session.planned - len(results))


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    return str(exc.message)[:300]
