"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

This module assembles the app; the parts live beside it: bodies.py (what a request may send), errors.py
(OpenAI's error shape), middleware.py (body size, API key, the 500 trap), routes.py (the routes by family)
and completions.py (answering a request, whole or streamed, tool calls included). With an API key, /v1/*
needs `Authorization: Bearer <key>`; /health and /metrics stay open. A request that fails logs its
traceback once, with the id its client got.
"""

from __future__ import annotations

from fastapi import FastAPI

from specstand.models import LoadedModel
from specstand.server.bodies import ServerLimits
from specstand.server.completions import Completer
from specstand.server.errors import add_error_handlers
from specstand.server.middleware import add_middleware
from specstand.server.routes import add_chat_routes, add_completion_routes, add_health_routes, add_model_routes
from specstand.server.worker import EngineWorker


def create_app(model: LoadedModel, worker: EngineWorker, served_name: str, limits: ServerLimits | None = None,
               tool_call_parser: str | None = None, api_key: str | None = None) -> FastAPI:
    """`tool_call_parser`: read tool calls out of answers to requests offering tools (None: never);
    `api_key`: the key /v1/* requires (None: open)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="specstand", docs_url=None, redoc_url=None)
    add_middleware(app, limits.max_body_bytes, api_key)
    add_error_handlers(app)
    completer = Completer(model, worker, served_name, limits)
    add_health_routes(app, worker)
    add_model_routes(app, served_name)
    add_chat_routes(app, completer, tool_call_parser)
    add_completion_routes(app, completer)
    return app
