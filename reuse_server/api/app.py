"""The FastAPI application around one engine."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from reuse_server.api.app_state import AppState
from reuse_server.api.errors import install_error_handlers
from reuse_server.api.metrics_page import MetricsPage
from reuse_server.api.routes import router
from reuse_server.api.settings import ServerSettings
from reuse_server.api.tokenizing import Tokenizing
from reuse_server.engine.structured_output import GrammarCompiler
from reuse_server.engine.client import EngineClient


def create_app(engine: EngineClient, metrics: MetricsPage, settings: ServerSettings | None = None) -> FastAPI:
    """metrics: what GET /metrics serves, built by the server and wired to the engine (server/metrics.py)."""
    settings = settings if settings is not None else ServerSettings()
    tokenizing = Tokenizing(engine.tokenizer, settings.tokenizer_threads, check_queue_room=engine.check_queue_room)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            tokenizing.close()

    app = FastAPI(title="kv-reuse-server", summary="OpenAI-compatible server that reuses KV cache",
                  lifespan=lifespan)
    AppState(engine, settings, tokenizing,
             GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids), metrics).attach(app)
    install_error_handlers(app)
    app.include_router(router)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without the 422 it declares for every body: bad bodies get 400 here (errors.py)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
