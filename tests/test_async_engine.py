"""The engine thread: built on the thread that runs it (one OpenMP pool in the process), load errors reach
the caller, and a thread that never started ends on shutdown."""

import asyncio
import threading

import pytest

from reuse_server.async_engine import AsyncEngine, EngineDeadError
from reuse_server.config import EngineConfig
from reuse_server.sampling_params import SamplingParams


def test_from_config_builds_the_engine_on_the_thread_that_runs_it(tiny_llama_path):
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_path), num_gpu_blocks=64))

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
    with pytest.raises(Exception):
        AsyncEngine.from_config(EngineConfig(model=str(tmp_path / "no-such-model")))
    assert not [t for t in threading.enumerate() if t.name == "engine" and t.is_alive()]


def test_shutdown_before_start_ends_the_engine_thread(tiny_llama_path):
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_path), num_gpu_blocks=64))
    thread = engine._thread
    assert thread.is_alive()
    asyncio.run(engine.shutdown())
    thread.join(10)
    assert not thread.is_alive()
