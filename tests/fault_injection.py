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


class Hang:
    """The switches of an engine whose step can be made to hang: set `hang` and the next step blocks (a step
    that does not return, as a kernel deadlock or a stuck tier read would) until `release` is set; `hung` is
    set once a step is blocked."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.hung = threading.Event()
        self.release = threading.Event()


def launch_hanging(config: EngineConfig, step_timeout: float) -> tuple[AsyncEngine, Hang]:
    switches = Hang()

    def build() -> LLMEngine:
        engine = build_engine(config)
        run_step = engine.runner.run

        def run_or_hang(*args, **kwargs):
            if switches.hang.is_set() and not switches.release.is_set():
                switches.hung.set()
                switches.release.wait()
            return run_step(*args, **kwargs)

        engine.runner.run = run_or_hang
        return engine

    return AsyncEngine.launch(build, step_timeout=step_timeout), switches
