"""The engine on a background thread, with an asyncio face for the HTTP server.

One thread owns the LLMEngine: it drains an inbox of adds and aborts, runs a step, and hands each
request's outputs to that request's asyncio queue. Nothing else touches the engine, so there are no
locks around the cache or the pool. A consumer that stops listening (client gone) aborts its request.

`launch` is the one way to start it: it builds the engine on that same thread, so that all of the process's
tensor work (loading, packing, calibration, steps) starts its OpenMP parallel regions from one thread.
libgomp keeps one pool of worker threads per thread that starts regions, and once the pools hold more threads
than there are CPUs it spins only ~100 times before a worker sleeps: every region then pays a futex wake, so a
model loaded on one thread and run on another makes every step slower.

Queue room: `check_queue_room(n)` refuses work before anything is queued (no KV block touched) when the engine is dead,
the server is draining for shutdown, or more than `max_waiting` requests would wait. A step that raises
leaves the pool's KV in an unknown state, so the engine is then declared dead (as vLLM does): every request
fails with EngineDeadError, new ones are refused, and /health says why, rather than serving KV that may be wrong.
A step that never returns is noticed by the watchdog (engine/watchdog.py, `step_timeout`): requests fail with
EngineStalled and new ones are refused until a step returns.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Callable

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.inbox import Abort, Add, InboxMessage, Precompute, Prefetch, Submission
from reuse_server.engine.builder import build_engine
from reuse_server.engine.model_names import ModelNames
from reuse_server.engine.outputs import Admission, RequestOutput
from reuse_server.engine.request_errors import (EngineDeadError, EngineStalled, QueueFull, RequestTimedOut,
                                                ServerDraining)
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.engine.watchdog import Watchdog

log = logging.getLogger(__name__)

SHUTDOWN_JOIN_SECONDS = 30.0
SHARED_WRITE_WAIT_TIMEOUTS = 4  # a finished request waits for its Redis writes at most this many --redis-timeout


class AsyncEngine:
    """Start it with `AsyncEngine.launch(...)`; the constructor is called on the engine thread by launch. What
    the HTTP layer may use of it is declared by engine/client.py's EngineClient."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, step_timeout: float | None = None) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.engine = engine
        engine.on_admitted = lambda admission: self._send(admission.request_id, admission)
        self.max_waiting = max_waiting
        self._inbox: deque[InboxMessage] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, OutputQueue] = {}
        self._snapshot = engine.snapshot()
        self._started = threading.Event()  # start() has handed over the event loop
        # Waiting requests, counted when queue room is checked: adds still in the inbox plus the scheduler's queue
        # as the engine thread last saw it (updated together, under the lock, so the sum never undercounts).
        self._count_lock = threading.Lock()
        self._inbox_adds = 0
        self._engine_waiting = 0
        # ... and their tokens (prompt, plus output of a preempted sequence), for the load a gateway reads
        self._inbox_tokens = 0
        self._engine_waiting_tokens = 0
        self.dead_reason: str | None = None
        self.draining = False
        self.watchdog = None if step_timeout is None else Watchdog(
            step_timeout, has_work=lambda: bool(self._queues or self._inbox), on_stall=self._stalled)

    @classmethod
    def launch(cls, build: Callable[[], LLMEngine] | EngineConfig, *, max_waiting: int | None = None,
               step_timeout: float | None = None) -> "AsyncEngine":
        """Start the engine thread, build the engine on it (`build` is an EngineConfig or a callable returning
        an LLMEngine), and return once it is built; the thread then waits for start() and runs it (see the
        module doc). A failed build raises here, in the caller, and the thread ends. step_timeout: seconds
        without progress, with work queued, after which the engine counts as stalled (None: no watchdog)."""
        make = (lambda: build_engine(build)) if isinstance(build, EngineConfig) else build
        built: Future = Future()

        def own_the_engine() -> None:
            try:
                async_engine = cls(make(), max_waiting, step_timeout)
            except BaseException as exc:  # reported to the caller; the thread ends
                built.set_exception(exc)
                return
            async_engine._thread = threading.current_thread()
            built.set_result(async_engine)
            async_engine._started.wait()
            if not async_engine._stop:
                async_engine._run()

        threading.Thread(target=own_the_engine, name="engine", daemon=True).start()
        return built.result()

    # what the API reads
    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def model_names(self) -> ModelNames:
        return self.engine.names

    @property
    def model_architecture(self) -> str:
        return self.engine.model_config.architecture

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

    @property
    def sizing(self):  # how the KV cache was sized at start (kv/sizing.py KVSizing): fixed, read from any thread
        return self.engine.sizing

    @property
    def kv_events(self) -> dict | None:
        """How routers subscribe to the engine's KV events (kv/events.py), None when it publishes none."""
        events = self.engine.events
        return events.describe() if events is not None else None

    @property
    def num_requests(self) -> int:
        """Requests in flight: submitted and not yet ended."""
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        """An upper bound of the requests waiting to be scheduled (what --max-waiting limits)."""
        with self._count_lock:
            return self._inbox_adds + self._engine_waiting

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens of the requests counted by num_waiting: what they will need in the KV pool once scheduled."""
        with self._count_lock:
            return self._inbox_tokens + self._engine_waiting_tokens

    @property
    def stalled_reason(self) -> str | None:
        return self.watchdog.stalled_reason if self.watchdog is not None else None

    def unavailable_reason(self) -> str | None:
        """Why the engine takes no new work, or None when it does."""
        if self.dead_reason is None and self._thread is not None and not self._thread.is_alive():
            self.dead_reason = "the engine thread has stopped"
        if self.dead_reason is not None:
            return self.dead_reason
        if self.stalled_reason is not None:
            return self.stalled_reason
        if self.draining:
            return "the server is shutting down"
        if self._thread is None or not self._started.is_set():
            return "the engine is not running"
        return None

    # lifecycle
    async def start(self) -> None:
        """Hand the running event loop to the engine thread (called once, by the app's lifespan)."""
        if self._started.is_set():
            return
        self._loop = asyncio.get_running_loop()
        self._started.set()

    async def settle_shared_writes(self) -> None:
        """Return once the blocks the pool has published so far are written to the shared tier (Redis), or
        after a bounded wait. A finished request's blocks are handed to the tier's background writer before
        its last output leaves the engine thread, so waiting here before answering means that the next turn
        of the conversation finds them on whichever replica it lands on. Without a shared tier, or when the
        writer has caught up already, nothing waits."""
        tiers = self.engine.tiers
        mark = tiers.shared_write_mark() if tiers is not None else None
        if mark is None or tiers.shared_writes_settled(mark):
            return
        timeout = SHARED_WRITE_WAIT_TIMEOUTS * self.engine.config.redis_timeout
        await asyncio.to_thread(tiers.shared_writes_settled, mark, timeout)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (ServerDraining); those in flight go on."""
        self.draining = True

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with `exc` (from the event loop); the engine aborts them."""
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(exc)
            self.abort(request_id)

    async def shutdown(self) -> None:
        """Stop the engine thread: requests still in it fail, then the engine's close() runs on that thread."""
        self.draining = True
        self._stop = True
        self._wake.set()
        self._started.set()  # a thread still waiting for start() ends
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, SHUTDOWN_JOIN_SECONDS)

    # requests
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check a request's prompt and parameters (LLMEngine.validate), on the caller's thread: the one check a
        request gets, before it is queued, so bad input is refused before any output or KV block. Returns
        the parameters to submit (its output limit fitted to the context and --max-tokens). The submissions
        below take validated input."""
        return self.engine.validate(prompt_token_ids, params)

    def check_queue_room(self, count: int = 1, ahead: int = 0) -> None:
        """Raise unless `count` more requests may be queued now. A request bigger than the whole queue (n
        choices, many precomputed chunks) is let in only into an empty one, so it is not refused forever.
        Call it right before generate(), with no await in between, so that nothing else is let in meanwhile.
        ahead: requests let in already and not queued yet (being tokenized), counted as waiting."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise self._refusal(reason)
        if self.max_waiting is None:
            return
        waiting = self.num_waiting + ahead
        if waiting and waiting + count > self.max_waiting:
            raise QueueFull(waiting, self.max_waiting, count)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 options: CacheOptions | None = None, deadline: float | None = None) -> "RequestStream":
        """Submit a validated request (validate_prompt) now and return its outputs' stream. `deadline` is an
        event-loop time (loop.time()) past which the request is aborted and its stream raises RequestTimedOut."""
        return self._open(Add(request_id, list(prompt_token_ids), params, options or CacheOptions()), deadline)

    def precompute(self, request_id: str, prompt_token_ids: list[int], options: CacheOptions,
                   deadline: float | None = None) -> "RequestStream":
        """Submit a chunk precompute (LLMEngine.precompute): one output, when its chunks are registered."""
        return self._open(Precompute(request_id, list(prompt_token_ids), options), deadline)

    def prefetch(self, request_id: str, prompt_token_ids: list[int], options: CacheOptions,
                 deadline: float | None = None) -> "RequestStream":
        """Submit a prefetch (LLMEngine.prefetch): one output, once the prompt's cached blocks are up."""
        return self._open(Prefetch(request_id, list(prompt_token_ids), options), deadline)

    def _refuse_if_dead(self) -> None:
        """Raise EngineDeadError (EngineStalled while the watchdog says so) unless the engine thread runs and
        takes work. Draining is check_queue_room()'s alone to refuse: choices let in before the drain began still start."""
        reason = self.unavailable_reason()
        if reason is not None and not (self.draining and self.dead_reason is None and self.stalled_reason is None):
            raise self._refusal(reason)

    def _open(self, submission: Submission, deadline: float | None) -> "RequestStream":
        self._refuse_if_dead()  # what check_queue_room() let in may meet a dead engine: its stream must not wait forever
        stream = RequestStream(self, submission.request_id, deadline)
        self._queues[submission.request_id] = stream.queue
        with self._count_lock:
            self._inbox_adds += 1
            self._inbox_tokens += len(submission.prompt_token_ids)
        self._submit(submission)
        return stream

    def _refusal(self, reason: str) -> Exception:
        if self.dead_reason is not None:
            return EngineDeadError(reason)
        if self.stalled_reason is not None:
            return EngineStalled(reason)
        return ServerDraining(reason) if self.draining else EngineDeadError(reason)

    def _stalled(self, reason: str) -> None:
        """From the watchdog's thread: fail every request in flight (their streams end with the error)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.fail_all, EngineStalled(f"request failed: {reason}"))
            except RuntimeError:  # the event loop is closed
                pass

    def abort(self, request_id: str) -> None:
        self._submit(Abort(request_id))

    def _forget(self, request_id: str, queue: asyncio.Queue) -> None:
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]

    # the engine thread
    def _submit(self, message: InboxMessage) -> None:
        # refused here, on the submitter's thread: on the engine thread an unknown message would stop the engine
        if not isinstance(message, InboxMessage):
            raise TypeError(f"the engine inbox takes {InboxMessage}, not {type(message).__name__}")
        self._inbox.append(message)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        queue = self._queues.get(request_id)
        if queue is None:
            return
        if isinstance(item, Admission):
            queue.admit(item)
        else:
            queue.put_nowait(item)

    def _send(self, request_id: str, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, request_id, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _drain_inbox(self) -> None:
        added = added_tokens = 0
        try:
            while self._inbox:
                message = self._inbox.popleft()
                if isinstance(message, Abort):
                    self.engine.abort(message.request_id)
                    continue
                added += 1
                added_tokens += len(message.prompt_token_ids)
                try:
                    self._take(message)
                except Exception as exc:  # validated already; anything here is reported to that request alone
                    self._send(message.request_id, exc)
        finally:
            self._count_waiting(added, added_tokens)

    def _take(self, submission: Submission) -> None:
        """Hand one submission to the engine (on the engine thread)."""
        match submission:
            case Add(request_id, prompt, params, options):
                self.engine.add(request_id, prompt, params, options)
            case Precompute(request_id, prompt, options):
                self.engine.precompute(request_id, prompt, options)
            case Prefetch(request_id, prompt, options):
                if (out := self.engine.prefetch(request_id, prompt, options)) is not None:
                    self._send(request_id, out)  # (else the pool was full: it comes from a later step)
            case _:  # _submit refuses anything else; a kind added to InboxMessage must be handled here
                raise TypeError(f"no engine call for {type(submission).__name__}")

    def _count_waiting(self, drained_adds: int = 0, drained_tokens: int = 0) -> None:
        waiting = self.engine.scheduler.waiting
        tokens = sum(seq.num_tokens for seq in waiting)
        with self._count_lock:
            self._inbox_adds -= drained_adds
            self._inbox_tokens -= drained_tokens
            self._engine_waiting = len(waiting)
            self._engine_waiting_tokens = tokens

    def _run(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start()
        try:
            self._serve()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()

    def _serve(self) -> None:
        beat = self.watchdog.beat if self.watchdog is not None else (lambda: None)
        try:
            while not self._stop:
                beat()
                self._drain_inbox()
                if not self.engine.has_work():
                    self._snapshot = self.engine.snapshot()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    log.exception("engine step failed; the engine stops, as its KV may be inconsistent")
                    self._die(f"an engine step failed: {type(exc).__name__}: {exc}")
                    return
                self._count_waiting()
                for out in outputs:
                    self._send(out.request_id, out)
                self._snapshot = self.engine.snapshot()
        except BaseException as exc:
            log.exception("the engine thread failed")
            self._die(f"the engine thread failed: {type(exc).__name__}: {exc}")
            return
        self._end_all(EngineDeadError("the server is shutting down"))
        self._close_engine()

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._end_all(EngineDeadError(f"request failed: {reason}"))

    def _end_all(self, exc: BaseException) -> None:
        """Abort every request the engine holds and fail every request submitted (including adds still in
        the inbox), so that no consumer waits forever."""
        try:
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
        except Exception:  # a dead engine may fail to abort; the consumers are told all the same
            log.exception("aborting the engine's requests failed")
        self._inbox.clear()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.fail_all, exc)
            except RuntimeError:  # the event loop is closed
                pass
        try:
            self._snapshot = self.engine.snapshot()
        except Exception:
            pass

    def _close_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the engine failed")


class OutputQueue(asyncio.Queue):
    """A request's outputs (or the error that ends it) in order, and apart from them the news of its admission,
    which comes before its first output and which a consumer may await while that output is computed."""

    def __init__(self) -> None:
        super().__init__()
        self.admission: Admission | None = None
        self.admitted = asyncio.Event()

    def admit(self, admission: Admission) -> None:
        self.admission = admission
        self.admitted.set()


class RequestStream:
    """One request's outputs as an async iterator. Closing it (aclose, or garbage collection) before its last
    output aborts the request, whether or not it was ever iterated."""

    def __init__(self, owner: AsyncEngine, request_id: str, deadline: float | None) -> None:
        self.request_id = request_id
        self.queue = OutputQueue()
        self._owner = owner
        self._deadline = deadline
        self._ended = False
        self._finalizer = weakref.finalize(self, _abandon, owner, request_id, self.queue)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._next()
        except BaseException:  # timed out, or the consumer was cancelled
            self.close()
            raise
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        if item.finished:
            self._end(abort=False)
            if item.finish_reason != "abort":
                await self._owner.settle_shared_writes()
        return item

    async def admitted(self) -> Admission:
        """Once the engine has let the request into its running batch (Admission). Waits for ever if it never
        is (an error or the end comes first): await it alongside the outputs."""
        await self.queue.admitted.wait()
        return self.queue.admission

    async def _next(self):
        if self._deadline is None:
            return await self.queue.get()
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(self.queue.get(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            raise RequestTimedOut("The request took longer than the server's request timeout and was "
                                  "aborted.") from None

    def close(self) -> None:
        if not self._ended:
            self._end(abort=True)

    async def aclose(self) -> None:
        self.close()

    def _end(self, abort: bool) -> None:
        self._ended = True
        self._finalizer.detach()
        _abandon(self._owner, self.request_id, self.queue, abort)


def _abandon(owner: AsyncEngine, request_id: str, queue: asyncio.Queue, abort: bool = True) -> None:
    owner._forget(request_id, queue)
    if abort:
        owner.abort(request_id)
