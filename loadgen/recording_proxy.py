"""A recording reverse proxy on loopback: a client that cannot be given an httpx transport (a coding agent's
own binary: Codex CLI, Claude Code) is pointed at it instead of the server, and every HTTP exchange it makes
is passed through unchanged (a stream chunk by chunk, as it arrives) and kept whole: request method, path,
headers and body, response status, headers and body. Tests read what an agent sent and what it was answered
(each response's usage: http_recorder.response_usage); a workload can replay the recorded requests.

Recordings live in memory only: an agent's requests carry its owner's prompts, which are not ours to store.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn

from loadgen.http_recorder import GENERATION_PATHS, carries_output, response_usage, usage_in_chat_terms

# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, not to the exchange; content-length and
# content-encoding are dropped because the body is passed on decoded and re-framed by the ASGI server.
_NOT_FORWARDED = {b"host", b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                  b"transfer-encoding", b"upgrade", b"content-length", b"content-encoding"}


@dataclass
class Exchange:
    """One request the client made and what the server answered (status None: the server was unreachable)."""
    method: str
    path: str  # with the query string, as the client sent it
    request_headers: dict[str, str]
    request_body: bytes
    status: int | None = None
    response_headers: dict[str, str] | None = None
    response_body: bytes = b""
    ttft_s: float | None = None  # request sent upstream -> first event with text or a tool call (None: none came)
    e2e_s: float | None = None  # request sent upstream -> the response's last byte

    @property
    def request_json(self) -> dict | None:
        try:
            data = json.loads(self.request_body)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    @property
    def is_generation(self) -> bool:
        return self.method == "POST" and self.path.split("?")[0].endswith(GENERATION_PATHS)

    @property
    def streamed(self) -> bool:
        return (self.response_headers or {}).get("content-type", "").startswith("text/event-stream")

    def usage(self) -> dict | None:
        """The response's usage in its dialect's own fields (None: an error, or no usage)."""
        if self.status != 200:
            return None
        return response_usage(self.response_body, self.streamed)

    def usage_in_chat_terms(self):
        usage = self.usage()
        return None if usage is None else usage_in_chat_terms(usage)


class FirstOutputClock:
    """Reads a server-sent-event stream as its chunks pass and notes when the first event carrying text or a
    tool call has arrived whole (as the client can read it), in seconds after `sent`."""

    def __init__(self, sent: float):
        self.sent = sent
        self.ttft_s: float | None = None
        self._pending = b""

    def read(self, chunk: bytes) -> None:
        if self.ttft_s is not None:
            return
        self._pending += chunk.replace(b"\r\n", b"\n")
        while self.ttft_s is None and b"\n\n" in self._pending:
            event, self._pending = self._pending.split(b"\n\n", 1)
            for line in event.splitlines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                try:
                    data = json.loads(line[len(b"data:"):])
                except ValueError:
                    continue
                if isinstance(data, dict) and carries_output(data):
                    self.ttft_s = time.perf_counter() - self.sent
                    return


class RecordingProxy:
    """An ASGI app forwarding every request to `upstream` (a base URL without a path) and appending each
    finished exchange to `exchanges` (in the order they finished; thread-safe to read with `snapshot`)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None

    def snapshot(self) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges)

    def clear(self) -> None:
        with self._lock:
            self.exchanges.clear()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # no timeout: a long prompt's prefill on a CPU takes as long as it takes, and the agent has its own
                self._client = httpx.AsyncClient(timeout=None)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _NOT_FORWARDED]
        exchange = Exchange(method=scope["method"], path=path,
                            request_headers={k.decode("latin-1"): v.decode("latin-1") for k, v in headers},
                            request_body=body)
        chunks: list[bytes] = []
        try:
            request = self._client.build_request(scope["method"], self.upstream + path, headers=headers, content=body)
            clock = FirstOutputClock(time.perf_counter())
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                exchange.response_body = f"proxy: upstream unreachable: {exc}".encode()
                await send({"type": "http.response.start", "status": 502,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": exchange.response_body})
                return
            exchange.status = response.status_code
            exchange.response_headers = dict(response.headers)
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await send({"type": "http.response.start", "status": response.status_code,
                            "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in _NOT_FORWARDED]})
                async for chunk in _until(response.aiter_bytes(), gone):
                    chunks.append(chunk)
                    if streamed:
                        clock.read(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if not gone.done():
                    await send({"type": "http.response.body", "body": b""})
            finally:
                gone.cancel()
                # closing the upstream response mid-body closes its connection: a client that left is gone for
                # the server too, which then aborts the request and frees what it held, as without the proxy
                await response.aclose()
                exchange.e2e_s = time.perf_counter() - clock.sent
                # a whole (unstreamed) answer reaches the client with its last byte
                exchange.ttft_s = clock.ttft_s if streamed else exchange.e2e_s
        finally:
            exchange.response_body = exchange.response_body or b"".join(chunks)
            with self._lock:
                self.exchanges.append(exchange)


async def _disconnected(receive) -> None:
    """Returns when the client has gone (ASGI's http.disconnect, once the request body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until(chunks: AsyncIterator[bytes], gone: asyncio.Future) -> AsyncIterator[bytes]:
    """`chunks` until they end or `gone` is done, whichever comes first (a long prefill sends nothing for
    minutes: waiting for the next chunk to find the client gone would keep the server computing for no one)."""
    chunks = aiter(chunks)
    while True:
        following = asyncio.ensure_future(anext(chunks))
        await asyncio.wait({following, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not following.done():
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            return
        try:
            yield following.result()
        except StopAsyncIteration:
            return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def recording_proxy(upstream: str, timeout: float = 20.0) -> Iterator[tuple[str, RecordingProxy]]:
    """Yields (the proxy's base URL, the RecordingProxy) with the proxy serving on a free loopback port in a
    thread of this process; stopped on the way out."""
    proxy = RecordingProxy(upstream)
    server = uvicorn.Server(uvicorn.Config(proxy, host="127.0.0.1", port=_free_port(), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="recording-proxy", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the recording proxy did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}", proxy
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
