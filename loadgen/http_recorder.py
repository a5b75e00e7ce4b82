"""Measures the generation requests of a client the load generator does not write itself (an agent framework,
a vendor SDK): an httpx transport that passes every request through and records, for each POST to
/chat/completions, /responses or /messages, a RequestResult with the same fields LoadClient.send fills in,
read from the HTTP exchange alone.

TTFT is the time until the first streamed event that carries text or a tool call; usage comes from the last
chunk (chat: the client must ask for `stream_options.include_usage`), from `response.completed` or, for an answer
cut by max_output_tokens, `response.incomplete` (Responses),
from `message_start` and `message_delta` (Anthropic Messages), or from a whole JSON body. Each dialect's usage
is read into chat's terms (prompt, completion and cached tokens). Once the phase's time is up, the transport
refuses new requests with `PhaseOver` instead of sending them.
"""
from __future__ import annotations

import functools
import json
import time
from types import SimpleNamespace

import httpx

from loadgen.results import RequestResult, apply_usage


class PhaseOver(Exception):
    """The phase's duration has passed: the request was not sent (raised as the HTTP library's TransportError
    too, so the SDK treats it as a connection failure)."""


GENERATION_PATHS = ("/chat/completions", "/responses", "/messages")


def _usage(data: dict) -> SimpleNamespace:
    """A response's `usage` in any of the three dialects, as chat's fields with attribute access (apply_usage)."""
    if "prompt_tokens" in data:  # chat completions
        details = data.get("prompt_tokens_details") or {}
        return SimpleNamespace(prompt_tokens=data.get("prompt_tokens"), completion_tokens=data.get("completion_tokens"),
                               prompt_tokens_details=SimpleNamespace(**details))
    if "input_tokens_details" in data:  # Responses: input_tokens counts the cached ones too
        details = data.get("input_tokens_details") or {}
        return SimpleNamespace(prompt_tokens=data.get("input_tokens"), completion_tokens=data.get("output_tokens"),
                               prompt_tokens_details=SimpleNamespace(**details))
    # Anthropic Messages: input_tokens are the uncached ones; the prompt is their sum with the cache's
    read = data.get("cache_read_input_tokens") or 0
    prompt = (data.get("input_tokens") or 0) + read + (data.get("cache_creation_input_tokens") or 0)
    return SimpleNamespace(prompt_tokens=prompt, completion_tokens=data.get("output_tokens"),
                           prompt_tokens_details=SimpleNamespace(cached_tokens=read))


def carries_output(data: dict) -> bool:
    """Whether a streamed event holds the first text or tool call, in any of the three dialects."""
    for choice in data.get("choices") or ():  # chat completions
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls"):
            return True
    kind = data.get("type")
    if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):  # Responses
        return bool(data.get("delta"))
    if kind == "response.output_item.added":
        return (data.get("item") or {}).get("type") == "function_call"
    if kind == "content_block_start":  # Anthropic Messages
        return (data.get("content_block") or {}).get("type") == "tool_use"
    if kind == "content_block_delta":
        delta = data.get("delta") or {}
        return bool(delta.get("text") or delta.get("partial_json"))
    return False


def _stream_usage(data: dict, usage: dict | None) -> dict | None:
    """The usage so far after one streamed event (Anthropic's comes in two parts: the prompt's at
    message_start, the output's at message_delta)."""
    kind = data.get("type")
    if kind in ("response.completed", "response.incomplete"):  # incomplete: cut by max_output_tokens
        return (data.get("response") or {}).get("usage") or usage
    if kind == "message_start":
        return dict((data.get("message") or {}).get("usage") or {})
    if kind == "message_delta" and data.get("usage"):
        return {**(usage or {}), **data["usage"]}
    if data.get("usage") and kind is None:
        return data["usage"]
    return usage


def sse_payloads(body: bytes):
    """The JSON payload of each `data:` line of a whole server-sent-event stream, in order ([DONE] left out)."""
    for line in body.splitlines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[len(b"data: "):])


def response_usage(body: bytes, streaming: bool) -> dict | None:
    """The `usage` of a whole recorded response, in its own dialect's fields (a stream's folded as a client
    reads it: Responses' from response.completed, Anthropic's from message_start and message_delta); None
    when it carries none."""
    if not streaming:
        data = json.loads(body) if body else {}
        return data.get("usage") if isinstance(data, dict) else None
    usage = None
    for data in sse_payloads(body):
        usage = _stream_usage(data, usage)
    return usage


def usage_in_chat_terms(usage: dict) -> SimpleNamespace:
    """Any dialect's usage as chat's prompt_tokens, completion_tokens and prompt_tokens_details.cached_tokens
    (for Anthropic, prompt_tokens is the sum of the uncached and the cached input)."""
    return _usage(usage)


@functools.cache
def recording_transport(h=httpx):
    """RecordingTransport for the HTTP library `h` an SDK is built on: httpx (openai) or httpx2 (anthropic 2.x),
    whose clients take only their own library's transports. Construct it as
    `recording_transport(h)(h.AsyncHTTPTransport(), session, phase_start, deadline, results)`."""

    class Refused(PhaseOver, h.TransportError):
        pass

    class _Watched(h.AsyncByteStream):
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
            if "error" in data or data.get("type") in ("error", "response.failed"):
                error = data.get("error") or (data.get("response") or {}).get("error") or data
                message = error.get("message", error) if isinstance(error, dict) else error
                self._result.error = f"in-stream error: {message}"[:300]
                return
            if self._result.ttft_s is None and carries_output(data):
                self._result.ttft_s = time.perf_counter() - self._sent
            self._usage = _stream_usage(data, self._usage)

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
            apply_usage(result, _usage(self._usage))
            result.ok = True


    class RecordingTransport(h.AsyncBaseTransport):
        """Records one RequestResult per generation request into `results`, turn by turn."""

        def __init__(self, inner: httpx.AsyncBaseTransport, session: str, phase_start: float, deadline: float,
                     results: list[RequestResult]):
            self._inner = inner
            self.session = session
            self.phase_start = phase_start
            self.deadline = deadline
            self.results = results
            self.refused = 0

        async def handle_async_request(self, request):
            if request.method != "POST" or not request.url.path.endswith(GENERATION_PATHS):
                return await self._inner.handle_async_request(request)
            sent = time.perf_counter()
            if sent >= self.deadline:
                self.refused += 1
                raise Refused("the phase's duration has passed", request=request)
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
                return h.Response(response.status_code, headers=response.headers, content=body,
                                      extensions=response.extensions)
            streaming = response.headers.get("content-type", "").startswith("text/event-stream")
            return h.Response(response.status_code, headers=response.headers,
                                  stream=_Watched(response.stream, result, sent, streaming),
                                  extensions=response.extensions)

        async def aclose(self) -> None:
            await self._inner.aclose()


    return RecordingTransport


RecordingTransport = recording_transport(httpx)


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message", err))[:300]
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace")
