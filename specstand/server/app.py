"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from specstand.engine import GenerationResult, Request, StepEvent
from specstand.models import LoadedModel, ModelError
from specstand.server.worker import EngineWorker, Overloaded
from specstand.verification import SamplingParams

DISCONNECT_POLL_S = 0.5


class ChatMessage(BaseModel):
    role: str
    content: str


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are accepted and ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def create_app(model: LoadedModel, worker: EngineWorker, served_name: str, default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="specstand", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: HttpRequest, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg')}", "invalid_request_error", where or None)

    @app.exception_handler(Exception)
    async def internal(_: HttpRequest, error: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(error).__name__}: {error}", "internal_error")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if worker.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "specstand",
                                            "created": int(time.time())}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        try:
            prompt_ids = model.encode_messages([m.model_dump() for m in body.messages])
        except ModelError as error:
            return error_response(400, str(error), "invalid_request_error", "messages")
        return await _complete(body, prompt_ids, http, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await _complete(body, model.encode_prompt(body.prompt), http, chat=False)

    async def _complete(body: _Sampling, prompt_ids: list[int], http: HttpRequest, chat: bool) -> Response:
        if body.model not in (None, served_name):
            return error_response(404, f"model {body.model!r} does not exist (serving {served_name!r})",
                                  "invalid_request_error", "model")
        try:
            request = Request(
                prompt_ids=prompt_ids,
                max_tokens=body.max_completion_tokens or body.max_tokens or default_max_tokens,
                sampling=SamplingParams(body.temperature, body.top_p, body.top_k, body.seed),
                stop_token_ids=model.stop_token_ids,
            )
            ticket, events = worker.submit(request)
        except ValueError as error:
            return error_response(400, str(error), "invalid_request_error")
        except Overloaded as error:
            return error_response(429, str(error), "rate_limit_error")
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": served_name}
        if body.stream:
            return StreamingResponse(_stream(ticket, events, meta, chat), media_type="text/event-stream")
        try:
            result = await _wait(ticket, events, http)
        except asyncio.CancelledError:
            worker.cancel(ticket)
            raise
        if result is None:
            return Response(status_code=499)  # the client went away; its slot is freed
        if isinstance(result, Exception):
            return error_response(500, f"engine failed: {result}", "internal_error")
        return JSONResponse(_full_response(result, meta, chat, len(prompt_ids)))

    async def _wait(ticket: int, events: asyncio.Queue, http: HttpRequest) -> GenerationResult | Exception | None:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await http.is_disconnected():
                    worker.cancel(ticket)
                    return None
                continue
            if isinstance(event, Exception):
                return event
            if event.finished is not None:
                return event.finished

    def _full_response(result: GenerationResult, meta: dict, chat: bool, prompt_tokens: int) -> dict:
        text = model.decode(result.output_ids)
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            **meta,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.output_ids),
                      "total_tokens": prompt_tokens + len(result.output_ids)},
            "specstand": {"token_ids": result.output_ids, "stats": result.stats.to_dict()},
        }

    async def _stream(ticket: int, events: asyncio.Queue, meta: dict, chat: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        token_ids: list[int] = []
        sent = ""
        finished = False
        try:
            if chat:
                yield _sse({**meta, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                                   "finish_reason": None}]})
            while not finished:
                event: StepEvent | Exception = await events.get()
                if isinstance(event, Exception):
                    yield _sse({"error": {"message": f"engine failed: {event}", "type": "internal_error"}})
                    break
                token_ids.extend(event.new_tokens)
                finished = event.finished is not None
                text = model.decode(token_ids)
                if text.endswith("\ufffd") and not finished:
                    continue  # an incomplete multi-byte character: wait for the rest
                delta, sent = text[len(sent):], text
                reason = event.finished.finish_reason if finished else None
                body = {"delta": {"content": delta}} if chat else {"text": delta}
                yield _sse({**meta, "object": kind, "choices": [{"index": 0, **body, "finish_reason": reason}]})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                worker.cancel(ticket)

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
