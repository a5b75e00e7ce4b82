"""The engine on a background thread, with an asyncio face for the HTTP server.

One thread owns the LLMEngine: it drains an inbox of adds and aborts, runs a step, and hands each
request's outputs to that request's asyncio queue. Nothing else touches the engine, so there are no
locks around the cache or the pool. A consumer that stops listening (client gone) aborts its request.

`from_config` builds the engine on that same thread, so that all of the process's tensor work (loading,
packing, calibration, steps) starts its OpenMP parallel regions from one thread. libgomp keeps one pool of
worker threads per thread that starts regions, and once the pools hold more threads than there are CPUs it
spins only ~100 times before a worker sleeps: every region then pays a futex wake. A model loaded on the
main thread and run on this one measured a 512-token warm request at 57-78 ms instead of 41-46 ms.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import AsyncIterator

from reuse_server.config import EngineConfig
from reuse_server.engine import LLMEngine
from reuse_server.outputs import RequestOutput
from reuse_server.sampling_params import CacheOptions, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._snapshot = engine.snapshot()
        self._started = threading.Event()  # start() has given the loop to a thread made by from_config

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        """Build the engine on a new thread, which then waits for start() and runs it (see the module doc).
        A failed load raises here, in the caller."""
        built: Future = Future()

        def own_the_engine() -> None:
            try:
                async_engine = cls(LLMEngine(config))
            except BaseException as exc:  # reported to the caller; the thread ends
                built.set_exception(exc)
                return
            built.set_result(async_engine)
            async_engine._started.wait()
            if not async_engine._stop:
                async_engine._run()

        thread = threading.Thread(target=own_the_engine, name="engine", daemon=True)
        thread.start()
        async_engine = built.result()
        async_engine._thread = thread
        return async_engine

    # what the API reads
    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:  # the model's logits, which may be more than the tokenizer's tokens
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.engine.eos_ids)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_sequence_tokens

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def metrics(self):
        return self.engine.metrics

    @metrics.setter
    def metrics(self, value) -> None:
        self.engine.metrics = value

    def snapshot(self) -> dict:
        return dict(self._snapshot)

    # lifecycle
    async def start(self) -> None:
        if self._thread is not None and self._started.is_set():
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()
        self._started.set()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._started.set()  # a from_config thread still waiting for start() ends
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    # requests
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache: CacheOptions | None = None) -> AsyncIterator[RequestOutput]:
        self.validate_prompt(prompt_token_ids, params)
        if self._thread is None or not self._started.is_set():
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit(("add", request_id, list(prompt_token_ids), params, cache or CacheOptions()))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    # the engine thread
    def _submit(self, item: tuple) -> None:
        self._inbox.append(item)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _send(self, request_id: str, item) -> None:
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, request_id, *rest = self._inbox.popleft()
            if kind == "add":
                try:
                    self.engine.add_request(request_id, *rest)
                except Exception as exc:  # validated already; anything here is reported to that request alone
                    self._send(request_id, exc)
            else:
                self.engine.abort(request_id)

    def _run(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_work():
                self._snapshot = self.engine.snapshot()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing the requests in it")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._send(out.request_id, out)
            self._snapshot = self.engine.snapshot()
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.seqs):
            self.engine.abort(request_id)
            self._send(request_id, EngineDeadError(f"request failed: {exc}"))
        self._snapshot = self.engine.snapshot()
