"""The seam between HTTP and the engine, held to its declaration (the project runs no type checker): api/ takes
the engine as an EngineClient (engine/client.py) and uses nothing of it that EngineClient does not declare,
the AsyncEngine it is given provides all of it, and the app's services are read through the one typed
AppState (api/app_state.py), not through loose keys on Starlette's app.state."""
import ast
import asyncio
from pathlib import Path

from starlette.requests import Request

from reuse_server.api.app import create_app
from reuse_server.server.metrics import wire_metrics
from reuse_server.api.app_state import AppState, app_state
from reuse_server.engine.async_engine import AsyncEngine
from reuse_server.engine.config import EngineConfig

API = Path(__file__).resolve().parents[2] / "reuse_server" / "api"


def declared() -> set[str]:
    """EngineClient's members, read from its source (a Protocol's attributes are not all in dir())."""
    tree = ast.parse((API.parent / "engine" / "client.py").read_text())
    protocol = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineClient")
    return {node.name for node in protocol.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def api_trees() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text(), filename=str(path)) for path in sorted(API.glob("*.py"))}


def is_engine(node: ast.expr) -> bool:
    """`engine` or `self.engine`: how api/ names the engine it was handed."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine" and isinstance(node.value, ast.Name)
        and node.value.id == "self")


def test_every_engine_parameter_in_api_is_an_engine_client():
    untyped = []
    for name, tree in api_trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "engine" and ast.unparse(arg.annotation or ast.Constant(None)) != "EngineClient":
                        untyped.append(f"{name}:{node.lineno} {node.name}")
    assert untyped == []


def test_api_uses_only_what_engine_client_declares():
    members = declared()
    undeclared = sorted({f"{name}:{node.lineno} engine.{node.attr}" for name, tree in api_trees().items()
                         for node in ast.walk(tree)
                         if isinstance(node, ast.Attribute) and is_engine(node.value) and node.attr not in members})
    assert undeclared == []


def test_api_reads_the_app_state_through_app_state_only():
    """Only app_state.py touches Starlette's app.state."""
    loose = sorted(f"{name}:{node.lineno} app.state.{node.attr}" for name, tree in api_trees().items()
                   if name != "app_state.py" for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                   and node.value.attr == "state" and ast.unparse(node.value.value).endswith("app"))
    assert loose == []


def test_async_engine_provides_what_engine_client_declares(tiny_llama_path):
    engine = AsyncEngine.launch(EngineConfig(model=str(tiny_llama_path), num_gpu_blocks=64))
    try:
        missing = sorted(name for name in declared() if not hasattr(engine, name))
        assert missing == []
        assert engine.model_architecture == engine.engine.model_config.architecture
        assert engine.kv_events is None  # the tiny engine publishes no KV events

        metrics = wire_metrics(engine)
        app = create_app(engine, metrics)
        state = app.state.services
        assert isinstance(state, AppState) and state.engine is engine and state.metrics is metrics
        assert app_state(Request({"type": "http", "app": app})) is state
        assert state.grammars is not None and state.tokenizing.tokenizer is engine.tokenizer
    finally:
        asyncio.run(engine.shutdown())
