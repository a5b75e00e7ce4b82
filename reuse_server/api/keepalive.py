"""Bytes on a silent stream: while a long prompt is computed (or a tool call is held back until it is whole)
a stream may send nothing for minutes, and clients, proxies and load balancers give up on a connection that
quiet (nginx's proxy_read_timeout is 60 s, an HTTP client's read timeout is per chunk). After `interval`
seconds without a frame, a keepalive frame is sent, and again every `interval` seconds of silence.

Each dialect keeps alive in its own way: Anthropic's Messages stream with its documented `ping` event (named
events must follow message_start, so none goes out before the first frame), OpenAI's streams with an SSE
comment line, which every SSE parser skips (what llama.cpp's server sends, its --sse-ping-interval), so it may
come at any time. Neither resets an SDK's idle timer on *events*: the Anthropic SDKs drop pings and SSE
parsers drop comments before any event reaches the application (docs/usage.md, "Coding agents")."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, ClassVar

from fastapi import Request

from reuse_server.api.app_state import app_state
from reuse_server.api.generation import sse_event


@dataclass(frozen=True)
class Keepalive:
    interval: float  # seconds of silence before a keepalive frame

    frame: ClassVar[str]
    before_first: ClassVar[bool]  # may come before the stream's first frame


@dataclass(frozen=True)
class AnthropicPing(Keepalive):
    """`event: ping`, as Anthropic's API sends it: only after message_start, in Anthropic's event order."""

    frame: ClassVar[str] = sse_event("ping", {"type": "ping"})
    before_first: ClassVar[bool] = False


@dataclass(frozen=True)
class CommentLine(Keepalive):
    """`: keepalive`, an SSE comment: no event to any SSE parser, so it may come before the first chunk."""

    frame: ClassVar[str] = ": keepalive\n\n"
    before_first: ClassVar[bool] = True


def keepalive_for(kind: type[Keepalive], request: Request) -> Keepalive | None:
    """The server's keepalive (--sse-keepalive seconds) in a dialect's kind; None where it is off."""
    interval = app_state(request).settings.sse_keepalive
    return kind(interval) if interval else None


_END = object()  # the frames have ended
_PING = object()  # a keepalive is due


@dataclass(frozen=True)
class _Failed:
    error: Exception


async def kept_alive(frames: AsyncIterator[str], keepalive: Keepalive | None) -> AsyncIterator[str]:
    """`frames`, with keepalive frames in their silences. One task reads `frames` into a queue for the stream's
    life and one wakes each `interval` to see whether the stream has been silent that long: a frame then costs a
    queue put and get, not a task and a timer of its own (that cost the event loop 0.08 ms a token at one
    stream). Closing this closes `frames` (a pending read of it is cancelled first, which ends it as a client
    gone would)."""
    if keepalive is None:
        async for frame in frames:
            yield frame
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    last, sent = loop.time(), False  # when the last frame went out; whether a frame of `frames` has

    async def read() -> None:
        try:
            async for frame in frames:
                queue.put_nowait(frame)
        except Exception as exc:  # noqa: BLE001 (raised again where the frames are read)
            queue.put_nowait(_Failed(exc))
        else:
            queue.put_nowait(_END)

    async def tick() -> None:
        while True:
            due = last + keepalive.interval - loop.time()
            if due > 0:
                await asyncio.sleep(due)
                continue
            if queue.empty() and (sent or keepalive.before_first):
                queue.put_nowait(_PING)
            await asyncio.sleep(keepalive.interval)

    tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(tick())]
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            if item is _PING:
                item = keepalive.frame
            else:
                sent = True
            last = loop.time()
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await frames.aclose()
