"""The services every request handler shares, built once with the app (app.py) and read through `app_state`.

One typed object rather than loose keys on Starlette's `app.state`: a handler names what it uses and gets
its type, and a key misspelt or never set fails where the app is built, not on some request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

if TYPE_CHECKING:  # annotations only: the handlers' modules import this one, and it needs none of them to run
    from reuse_server.api.metrics_page import MetricsPage
    from reuse_server.api.settings import ServerSettings
    from reuse_server.api.tokenizing import Tokenizing
    from reuse_server.engine.client import EngineClient
    from reuse_server.engine.structured_output import GrammarCompiler


@dataclass(frozen=True)
class AppState:
    engine: EngineClient
    settings: ServerSettings  # its api_keys and responses (the response store) too
    tokenizing: Tokenizing  # prompts are tokenized on these threads, not on the event loop
    grammars: GrammarCompiler  # tools and response_format grammars, compiled once per shape
    metrics: MetricsPage  # what GET /metrics renders, built and wired to the engine by server/

    def attach(self, app: FastAPI) -> None:
        app.state.services = self


def app_state(request: Request) -> AppState:
    return request.app.state.services
