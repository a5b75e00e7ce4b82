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


async def kept_alive(frames: AsyncIterator[str], keepalive: Keepalive | None) -> AsyncIterator[str]:
    """`frames`, with keepalive frames in their silences. Closing this closes `frames` (a pending read of it is
    cancelled first, which ends it as a client gone would)."""
    if keepalive is None:
        async for frame in frames:
            yield frame
        return
    pending: asyncio.Future | None = None
    sent = False
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(frames))
            done, _ = await asyncio.wait({pending}, timeout=keepalive.interval)
            if not done:
                if sent or keepalive.before_first:
                    yield keepalive.frame
                continue
            task, pending = pending, None
            try:
                frame = task.result()
            except StopAsyncIteration:
                return
            sent = True
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await frames.aclose()
