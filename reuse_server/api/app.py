"""The FastAPI application around one engine."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from reuse_server.api.errors import install_error_handlers
from reuse_server.api.routes import router
from reuse_server.metrics import ServerMetrics
from reuse_server.structured_output import GrammarCompiler


def create_app(engine, metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics if metrics is not None else ServerMetrics(engine)
    engine.metrics = metrics  # the engine reports TTFT and request ends to it

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="kv-reuse-server", summary="OpenAI-compatible server that reuses KV cache",
                  lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    install_error_handlers(app)
    app.include_router(router)
    return app
