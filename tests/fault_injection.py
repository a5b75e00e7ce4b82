"""A real engine with a fault switch where the model runs, as a device error would surface: its steps run
normally until the returned event is set, then raise. For the tests of what a dead engine does."""
import threading

from reuse_server.engine.async_engine import AsyncEngine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.engine import LLMEngine
from reuse_server.engine.builder import build_engine

FAULT = "injected device fault"


def launch_faulty(config: EngineConfig) -> tuple[AsyncEngine, threading.Event]:
    fault = threading.Event()

    def build() -> LLMEngine:
        engine = build_engine(config)
        run_step = engine.runner.run

        def run_or_fail(*args, **kwargs):
            if fault.is_set():
                raise RuntimeError(FAULT)
            return run_step(*args, **kwargs)

        engine.runner.run = run_or_fail
        return engine

    return AsyncEngine.launch(build), fault
