"""The engine thread: launched one way (built on the thread that runs it, one OpenMP pool in the process), load
errors reach the caller, a thread that never started ends on shutdown, the waiting queue is bounded at
admission, a deadline aborts a request, and a failed step makes the engine dead rather than hung."""

import asyncio
import threading

import pytest

from fault_injection import FAULT, launch_faulty
from reuse_server.engine.async_engine import AsyncEngine, EngineDeadError, QueueFull, RequestTimedOut
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.model.errors import ModelLoadError


def test_launch_builds_the_engine_on_the_thread_that_runs_it(tiny_llama_path):
    engine = AsyncEngine.launch(EngineConfig(model=str(tiny_llama_path), num_gpu_blocks=64))

    async def run():
        with pytest.raises(EngineDeadError):  # not started yet: nothing is accepted
            async for _ in engine.generate("early", [3, 4, 5], SamplingParams(max_tokens=2)):
                pass
        await engine.start()
        outputs = [out async for out in engine.generate("r", list(range(3, 30)), SamplingParams(max_tokens=4))]
        thread = engine._thread
        await engine.shutdown()
        return outputs, thread

    outputs, thread = asyncio.run(run())
    assert engine.engine.built_on == thread.ident != threading.get_ident()
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 4
    assert not thread.is_alive()
    assert engine.engine.cache.stats().in_use_blocks == 0


def test_a_failed_load_raises_in_the_caller(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        AsyncEngine.launch(EngineConfig(model=str(tmp_path / "no-such-model")))
    assert not [t for t in threading.enumerate() if t.name == "engine" and t.is_alive()]


def test_shutdown_before_start_ends_the_engine_thread(tiny_llama_path):
    engine = AsyncEngine.launch(EngineConfig(model=str(tiny_llama_path), num_gpu_blocks=64))
    thread = engine._thread
    assert thread.is_alive()
    asyncio.run(engine.shutdown())
    thread.join(10)
    assert not thread.is_alive()


def _config(path, **overrides) -> EngineConfig:
    return EngineConfig(model=str(path), **{"block_size": 4, "num_gpu_blocks": 512, **overrides})


LONG = SamplingParams(max_tokens=400, ignore_eos=True)


async def _first_output(stream):
    return await stream.__anext__()


async def _wait_for(condition, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_launch_takes_a_builder_run_on_the_engine_thread(tiny_llama_path):
    from reuse_server.engine.builder import build_engine

    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return build_engine(_config(tiny_llama_path))

    engine = AsyncEngine.launch(build)
    assert built_on == [engine._thread] and built_on[0] is not threading.current_thread()
    asyncio.run(engine.shutdown())


def test_the_waiting_queue_is_bounded_at_admission(tiny_llama_path):
    """One sequence runs at a time and two may wait: a third waiting request is refused before anything is
    queued; a request larger than the whole queue still gets in when the queue is empty."""
    engine = AsyncEngine.launch(_config(tiny_llama_path, max_num_seqs=1), max_waiting=2)

    async def run():
        await engine.start()
        engine.check_queue_room(1)
        running = engine.generate("running", list(range(3, 20)), LONG)
        await _first_output(running)  # scheduled: it no longer waits
        engine.check_queue_room(2)
        waiting = [engine.generate(f"waiting-{i}", list(range(5, 20)), LONG) for i in range(2)]
        assert engine.num_waiting == 2
        with pytest.raises(QueueFull) as refused:
            engine.check_queue_room(1)
        assert (refused.value.waiting, refused.value.limit) == (2, 2)
        assert engine.num_requests == 3  # the refused one was never submitted
        for stream in [running, *waiting]:
            await stream.aclose()
        await _wait_for(lambda: engine.num_waiting == 0 and engine.snapshot()["running"] == 0)
        engine.check_queue_room(5)  # bigger than the queue, but the queue is empty
        await engine.shutdown()

    asyncio.run(run())
    assert engine.engine.cache.stats().in_use_blocks == 0


def test_an_unknown_inbox_message_is_refused_by_the_submitter(tiny_llama_path):
    """The inbox takes its typed messages (engine/inbox.py) only: anything else (here the string-tagged tuple
    the inbox once took) raises on the submitter's thread, never reaches the engine thread, and the engine
    goes on serving."""
    engine = AsyncEngine.launch(_config(tiny_llama_path))

    async def run():
        await engine.start()
        with pytest.raises(TypeError, match="inbox"):
            engine._submit(("add", "tagged", [3, 4, 5], SamplingParams(max_tokens=2), CacheOptions()))
        assert not engine._inbox
        outputs = [out async for out in engine.generate("typed", list(range(3, 20)), SamplingParams(max_tokens=3))]
        reason = engine.unavailable_reason()
        await engine.shutdown()
        return outputs, reason

    outputs, reason = asyncio.run(run())
    assert reason is None
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 3


def test_a_deadline_aborts_the_request_and_frees_its_blocks(tiny_llama_path):
    # 4,000 tokens are seconds of the tiny model, far past the deadline (1,000 were ~0.4 s, too close to 0.3)
    engine = AsyncEngine.launch(_config(tiny_llama_path, num_gpu_blocks=1040))

    async def run():
        await engine.start()
        loop = asyncio.get_running_loop()
        stream = engine.generate("slow", list(range(3, 30)), SamplingParams(max_tokens=4000, ignore_eos=True),
                                 deadline=loop.time() + 0.3)
        outputs = []
        with pytest.raises(RequestTimedOut):
            async for out in stream:
                outputs.append(out)
        assert outputs and not outputs[-1].finished  # it was generating when the deadline struck
        await _wait_for(lambda: engine.snapshot()["running"] == 0 and engine.snapshot()["in_use_blocks"] == 0)
        assert engine.num_requests == 0
        await engine.shutdown()

    asyncio.run(run())


def test_a_failed_step_makes_the_engine_dead_not_hung(tiny_llama_path):
    """A fault injected where the model runs (as a device error would surface): the request in flight fails,
    new requests are refused with the reason, and nothing waits forever."""
    engine, fault = launch_faulty(_config(tiny_llama_path))

    async def run():
        await engine.start()
        stream = engine.generate("victim", list(range(3, 30)), LONG)
        await _first_output(stream)
        queued = engine.generate("queued", list(range(3, 12)), LONG)
        fault.set()
        for s in (stream, queued):
            with pytest.raises(EngineDeadError, match=FAULT):
                await asyncio.wait_for(_drain(s), 10)
        assert FAULT in engine.unavailable_reason()
        with pytest.raises(EngineDeadError):
            engine.check_queue_room(1)
        with pytest.raises(EngineDeadError):
            engine.generate("late", [3, 4, 5], SamplingParams(max_tokens=2))
        await engine.shutdown()

    asyncio.run(run())
    assert not engine._thread.is_alive()


async def _drain(stream) -> None:
    async for _ in stream:
        pass
