"""The OpenAI-compatible HTTP layer: `reuse_server.api.app.create_app(engine)` builds the FastAPI app."""
