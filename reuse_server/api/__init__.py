"""The OpenAI-compatible HTTP layer: `reuse_server.api.app.create_app(engine, metrics)` builds the FastAPI app."""
