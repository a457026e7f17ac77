"""The routes, by family: health and metrics, the model list, chat completions, plain completions."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from specstand.server.bodies import ChatCompletionRequest, CompletionRequest, message_dict
from specstand.server.completions import Completer, ToolParsing
from specstand.server.errors import Refused, error_response
from specstand.server.tool_calls import offered_tool_names
from specstand.server.worker import EngineWorker


def add_health_routes(app: FastAPI, worker: EngineWorker) -> None:
    """/health (503 with the reason when the engine cannot serve), /metrics (Prometheus text) and
    /reset_prefix_cache."""

    @app.get("/health")
    async def health() -> Response:
        problem = worker.problem()
        if problem:
            return error_response(503, problem, "unhealthy")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        worker.account_idle()
        return Response(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's route: cached prompts are forgotten, and here the drafter's memory of earlier answers
        too, so that a benchmark's runs each start from the same state."""
        worker.forget_history()
        return Response(status_code=200)


def add_model_routes(app: FastAPI, served_name: str) -> None:
    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "specstand",
                                            "created": int(time.time())}]}


def add_chat_routes(app: FastAPI, completer: Completer, tool_call_parser: str | None) -> None:
    """/v1/chat/completions; with `tool_call_parser`, answers to requests offering tools are read for calls."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        http.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        completer.check(body)
        if body.tool_choice not in (None, "auto", "none"):
            raise Refused(400, "tool_choice other than 'auto' or 'none' is not supported (it needs constrained "
                               "decoding)", "tool_choice")
        messages = [message_dict(m) for m in body.messages]
        tools = body.tools if body.tool_choice != "none" else None
        prompt_ids = await completer.tokenize(completer.model.encode_messages, messages, tools=tools)
        parsing = ToolParsing(tool_call_parser, offered_tool_names(tools)) if tool_call_parser and tools else None
        return await completer.complete(body, prompt_ids, http, chat=True, parsing=parsing, tools=tools)


def add_completion_routes(app: FastAPI, completer: Completer) -> None:
    """/v1/completions: a text prompt, or token ids used as they are."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        http.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        completer.check(body)
        if isinstance(body.prompt, list):
            return await completer.complete(body, completer.check_prompt_ids(body), http, chat=False)
        prompt_ids = await completer.tokenize(completer.model.encode_prompt, body.prompt)
        return await completer.complete(body, prompt_ids, http, chat=False)
