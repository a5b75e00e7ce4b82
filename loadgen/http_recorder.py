"""Measures the chat requests of a client the load generator does not write itself (an agent framework): an
httpx transport that passes every request through and records, for each POST to /chat/completions, a
RequestResult with the same fields LoadClient.send fills in, read from the HTTP exchange alone.

TTFT is the time until the first streamed chunk that carries text or a tool call; usage comes from the
last chunk (the client must ask for `stream_options.include_usage`) or from a whole JSON body. Once the
phase's time is up, the transport refuses new requests with `PhaseOver` instead of sending them.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx

from loadgen.results import RequestResult


class PhaseOver(httpx.TransportError):
    """The phase's duration has passed: the request was not sent."""


def _usage(data: dict) -> SimpleNamespace:
    """The `usage` object of a response, with attribute access as apply_usage reads it."""
    return SimpleNamespace(prompt_tokens=data.get("prompt_tokens"), completion_tokens=data.get("completion_tokens"),
                           prompt_tokens_details=SimpleNamespace(**(data.get("prompt_tokens_details") or {})))


class _Watched(httpx.AsyncByteStream):
    """A response body passed through unchanged while its server-sent events (or JSON) are read."""

    def __init__(self, inner: httpx.AsyncByteStream, result: RequestResult, sent: float, streaming: bool):
        self._inner, self._result, self._sent, self._streaming = inner, result, sent, streaming
        self._pending = b""
        self._body = b""
        self._usage: dict | None = None
        self._done = False

    async def __aiter__(self):
        async for chunk in self._inner:
            self._read(chunk)
            yield chunk
        self._finish()

    async def aclose(self) -> None:
        await self._inner.aclose()
        self._finish()

    def _read(self, chunk: bytes) -> None:
        if not self._streaming:
            self._body += chunk
            return
        self._pending += chunk
        while b"\n\n" in self._pending:
            event, self._pending = self._pending.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    self._event(json.loads(line[len(b"data: "):]))

    def _event(self, data: dict) -> None:
        if "error" in data:
            self._result.error = f"in-stream error: {data['error'].get('message', data['error'])}"[:300]
            return
        if self._result.ttft_s is None:
            for choice in data.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    self._result.ttft_s = time.perf_counter() - self._sent
        if data.get("usage"):
            self._usage = data["usage"]

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        result = self._result
        result.e2e_s = time.perf_counter() - self._sent
        if not self._streaming and self._body:
            self._usage = json.loads(self._body).get("usage")
            result.ttft_s = result.e2e_s  # a whole answer: its first token reached the client with the last
        if result.error is not None:
            return
        if self._usage is None:
            result.error = "the response ended without usage"
            return
        from loadgen.client import apply_usage  # loadgen.client builds this transport

        apply_usage(result, _usage(self._usage))
        result.ok = True


class RecordingTransport(httpx.AsyncBaseTransport):
    """Records one RequestResult per chat completion request into `results`, turn by turn."""

    def __init__(self, inner: httpx.AsyncBaseTransport, session: str, phase_start: float, deadline: float,
                 results: list[RequestResult]):
        self._inner = inner
        self.session = session
        self.phase_start = phase_start
        self.deadline = deadline
        self.results = results
        self.refused = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return await self._inner.handle_async_request(request)
        sent = time.perf_counter()
        if sent >= self.deadline:
            self.refused += 1
            raise PhaseOver("the phase's duration has passed", request=request)
        result = RequestResult(session=self.session, turn=len(self.results), ok=False, start_s=sent - self.phase_start)
        self.results.append(result)
        try:
            response = await self._inner.handle_async_request(request)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            result.e2e_s = time.perf_counter() - sent
            raise
        if response.status_code >= 400:
            body = await response.aread()
            result.error = f"HTTP {response.status_code}: {_error_message(body)}"
            result.e2e_s = time.perf_counter() - sent
            return httpx.Response(response.status_code, headers=response.headers, content=body,
                                  extensions=response.extensions)
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_Watched(response.stream, result, sent, streaming),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message", err))[:300]
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace")
