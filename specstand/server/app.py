"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

What a request can break stays with that request: sizes are bounded at the door (body bytes, prompt
characters), every sampling field is range-checked, a field the engine cannot honour is refused with a
400 naming it (never silently ignored), tokenisation runs off the event loop, and each request has a
server-side deadline.

With a tool-call parser (`--enable-auto-tool-choice`), a chat request that offers `tools` gets the calls
in the answer as `message.tool_calls` (streamed as OpenAI streams them); see tool_calls.py. With an API
key, /v1/* needs `Authorization: Bearer <key>`; /health and /metrics stay open. A request that fails logs
its traceback once, with the id its client got.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from specstand.engine import DecodeStats, GenerationResult, Request, StepEvent
from specstand.models import LoadedModel, ModelError
from specstand.server.tool_calls import ToolCall, ToolCallStream, offered_tool_names, parse_answer
from specstand.server.worker import EngineWorker, Overloaded
from specstand.verification import SamplingParams

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does): their distribution is a point


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * 2**20
    max_prompt_chars: int = 1_000_000  # checked before tokenising
    request_timeout_s: float = 600.0  # server-side deadline of a request, queueing included
    default_max_tokens: int = 256  # when the client sends none (cut to what the context leaves)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # chat templates may read more (e.g. `reasoning_content`)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields no engine needs (user, metadata, ...) are ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0, le=100, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1)  # -1 or 0: no top-k cut (vLLM uses -1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool = False
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    # refused unless left at their neutral value: the engine cannot honour them
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something the engine does not do, or None."""
        if self.logprobs or self.top_logprobs:
            return "logprobs"
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                return name
        if self.logit_bias:
            return "logit_bias"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        return None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)  # text, or token ids as the OpenAI API allows


class _Refused(Exception):
    """A request the server answers with a 4xx: status, message, error type, parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 before anything parses it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send) -> None:
        response = error_response(413, f"request body over {self.limit} bytes", "invalid_request_error")
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class FailureTrap:
    """ASGI middleware: an unexpected exception becomes a 500 in OpenAI's error shape (if the response has
    not started) and its traceback is logged once, with the request id the client got. Starlette's own
    handler for Exception would re-raise it for the server to log a second time."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as error:  # noqa: BLE001 - the request fails, the server goes on
            request_id = scope.get("state", {}).get("request_id", "-")
            logger.error("request %s failed: %s %s", request_id, scope.get("method"), scope["path"], exc_info=error)
            if not started:
                message = f"internal error (request {request_id}): {type(error).__name__}: {error}"
                await error_response(500, message, "internal_error")(scope, receive, send)


class ApiKeyCheck:
    """ASGI middleware: /v1/* without `Authorization: Bearer <key>` gets a 401 in OpenAI's error shape."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = "invalid API key" if given else "missing API key: send the header Authorization: Bearer <key>"
        response = error_response(401, message, "authentication_error")
        await response(scope, receive, send)


@dataclass(frozen=True)
class ToolParsing:
    """How this request's answer is read for tool calls: the parser and the names the request offers."""

    parser: str
    tool_names: frozenset[str]


def _message_dict(message: ChatMessage) -> dict:
    """A message as chat templates read it: content parts joined into text (text parts only)."""
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise _Refused(400, f"content part type {part.type!r} is not supported (text only)", "messages")
            texts.append(part.text)
        out["content"] = "".join(texts)
    elif message.content is None:
        out["content"] = None if message.tool_calls else ""
    return out


def _prompt_chars(body: _Sampling) -> int:
    if isinstance(body, CompletionRequest):
        return len(body.prompt)
    total = 0
    for m in body.messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(p.text or "") for p in m.content)
        total += len(json.dumps(m.tool_calls)) if m.tool_calls else 0
    return total + (len(json.dumps(body.tools)) if body.tools else 0)


def create_app(model: LoadedModel, worker: EngineWorker, served_name: str, limits: ServerLimits | None = None,
               tool_call_parser: str | None = None, api_key: str | None = None) -> FastAPI:
    """`tool_call_parser`: read tool calls out of answers to requests offering tools (None: never);
    `api_key`: the key /v1/* requires (None: open)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="specstand", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, key=api_key)
    app.add_middleware(FailureTrap)  # outermost: it sees whatever the others let through
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="specstand-tokenizer")  # one at a time

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: HttpRequest, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg')}", "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HttpRequest, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "internal_error"
        return error_response(error.status_code, str(error.detail), kind)

    @app.exception_handler(_Refused)
    async def refused(_: HttpRequest, error: _Refused) -> JSONResponse:
        return error_response(error.status, error.message, error.kind, error.param)

    @app.get("/health")
    async def health() -> Response:
        problem = worker.problem()
        if problem:
            return error_response(503, problem, "unhealthy")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "specstand",
                                            "created": int(time.time())}]}

    async def tokenize(function, *args, **kwargs) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(tokenizer_thread, lambda: function(*args, **kwargs))
        except ModelError as error:
            raise _Refused(400, str(error), "messages") from None
        except Exception as error:  # a chat template that cannot render these messages is the client's input
            raise _Refused(400, f"the chat template failed on these messages: {type(error).__name__}: {error}",
                           "messages") from None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        http.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        _check(body)
        if body.tool_choice not in (None, "auto", "none"):
            raise _Refused(400, "tool_choice other than 'auto' or 'none' is not supported (it needs constrained "
                                "decoding)", "tool_choice")
        messages = [_message_dict(m) for m in body.messages]
        tools = body.tools if body.tool_choice != "none" else None
        prompt_ids = await tokenize(model.encode_messages, messages, tools=tools)
        parsing = ToolParsing(tool_call_parser, offered_tool_names(tools)) if tool_call_parser and tools else None
        return await _complete(body, prompt_ids, http, chat=True, parsing=parsing, tools=tools)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        http.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        _check(body)
        if isinstance(body.prompt, list):  # token ids: used as they are (what train-data --endpoint sends)
            vocab = model.decoder.shape.vocab_size
            if not all(0 <= t < vocab for t in body.prompt):
                raise _Refused(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            return await _complete(body, list(body.prompt), http, chat=False)
        return await _complete(body, await tokenize(model.encode_prompt, body.prompt), http, chat=False)

    def _check(body: _Sampling) -> None:
        if body.model not in (None, served_name):
            raise _Refused(404, f"model {body.model!r} does not exist (serving {served_name!r})", "model")
        field = body.unsupported()
        if field:
            raise _Refused(400, f"{field} is not supported by this server", field)
        if _prompt_chars(body) > limits.max_prompt_chars:
            raise _Refused(400, f"the prompt is over {limits.max_prompt_chars} characters", "messages")

    def _request(body: _Sampling, prompt_ids: list[int], tools: list[dict] | None) -> Request:
        room = worker.engine.runner.capacity - len(prompt_ids) - worker.engine.width + 1
        if room <= 0:
            raise _Refused(400, f"the prompt ({len(prompt_ids)} tokens) fills the context of "
                                f"{worker.engine.runner.capacity} tokens", "messages")
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked or min(limits.default_max_tokens, room)
        temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
        seed = None if body.seed is None else body.seed % 2**64
        try:
            return Request(prompt_ids, max_tokens, SamplingParams(temperature, body.top_p, max(body.top_k, 0), seed),
                           model.stop_token_ids, tools, body.response_format)
        except ValueError as error:
            raise _Refused(400, str(error)) from None

    async def _complete(body: _Sampling, prompt_ids: list[int], http: HttpRequest, chat: bool,
                        parsing: ToolParsing | None = None, tools: list[dict] | None = None) -> Response:
        request = _request(body, prompt_ids, tools)  # the tools offered, which schema drafting follows
        try:
            ticket, events = worker.submit(request)
        except ValueError as error:
            raise _Refused(400, str(error), "max_tokens") from None
        except Overloaded as error:
            raise _Refused(429, str(error), kind="rate_limit_error") from None
        meta = {"id": http.state.request_id, "created": int(time.time()), "model": served_name}
        answer = _Answer(model, body.stop_strings())
        deadline = time.monotonic() + limits.request_timeout_s
        if body.stream:
            return StreamingResponse(_stream(ticket, events, answer, meta, chat, deadline, parsing),
                                     media_type="text/event-stream")
        try:
            outcome = await _wait(ticket, events, answer, http, deadline)
        except asyncio.CancelledError:
            worker.cancel(ticket)
            raise
        if outcome == "disconnected":
            return Response(status_code=499)  # the client went away; its slot is freed
        if outcome == "timeout":
            return error_response(504, f"no answer within {limits.request_timeout_s:g} s", "timeout")
        if isinstance(outcome, Exception) or outcome.finish_reason == "error":
            message = _failure(meta["id"], outcome)
            return error_response(500, message, "internal_error")
        return JSONResponse(_full_response(answer, outcome, meta, chat, len(prompt_ids), parsing))

    def _failure(request_id: str, outcome: Exception | GenerationResult) -> str:
        """The client's message for a request the engine failed, logged (the engine or its worker logged the
        traceback, with the engine's request id, which this line ties to the client's)."""
        if isinstance(outcome, Exception):
            message = f"engine failed: {type(outcome).__name__}: {outcome}"
        else:
            message = f"this request failed in the engine: {outcome.error}"
        engine_id = "" if isinstance(outcome, Exception) else f" (engine request {outcome.request_id})"
        logger.error("request %s%s: %s", request_id, engine_id, message)
        return f"{message} (request {request_id})"

    async def _next_event(events: asyncio.Queue, deadline: float, http: HttpRequest | None):
        """The next engine event, "timeout" past the deadline, or "disconnected" once the client left."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            try:
                return await asyncio.wait_for(events.get(), min(DISCONNECT_POLL_S, left))
            except TimeoutError:
                if http is not None and await http.is_disconnected():
                    return "disconnected"

    async def _wait(ticket: int, events: asyncio.Queue, answer: _Answer, http: HttpRequest, deadline: float):
        while True:
            event = await _next_event(events, deadline, http)
            if isinstance(event, (str, Exception)):
                if isinstance(event, str):
                    worker.cancel(ticket)
                return event
            answer.add(event)
            if event.finished is not None:
                return event.finished
            if answer.stopped:  # a stop string: the engine can drop the rest
                worker.cancel(ticket)
                return GenerationResult(event.request_id, [], answer.token_ids, "stop", DecodeStats())

    def _full_response(answer: _Answer, result: GenerationResult, meta: dict, chat: bool, prompt_tokens: int,
                       parsing: ToolParsing | None) -> dict:
        text = answer.text()
        reason = "stop" if answer.stopped else result.finish_reason
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            parsed = parse_answer(text, parsing.parser, parsing.tool_names) if parsing else None
            if parsed and parsed.tool_calls:
                choice["message"] = {"role": "assistant", "content": parsed.content,
                                     "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
                choice["finish_reason"] = _with_calls(reason)
        else:
            choice["text"] = text
        completion_tokens = len(answer.token_ids)
        return {
            **meta,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "specstand": {"token_ids": answer.token_ids, "stats": result.stats.to_dict()},
        }

    async def _stream(ticket: int, events: asyncio.Queue, answer: _Answer, meta: dict, chat: bool,
                      deadline: float, parsing: ToolParsing | None) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        calls = ToolCallStream(parsing.parser, parsing.tool_names) if parsing else None
        called = 0  # tool calls streamed so far
        finished = False
        try:
            if chat:
                yield _sse({**meta, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                                   "finish_reason": None}]})
            while not finished:
                event = await _next_event(events, deadline, None)
                if isinstance(event, (str, Exception)) or (
                    event.finished is not None and event.finished.finish_reason == "error"
                ):
                    yield _sse({"error": {"message": _stream_failure(meta["id"], event), "type": "internal_error"}})
                    break
                answer.add(event)
                finished = event.finished is not None or answer.stopped
                delta = answer.new_text(final=finished)
                if delta is None:
                    continue  # an incomplete multi-byte character: wait for the rest
                reason = None
                if finished:
                    reason = "stop" if answer.stopped else event.finished.finish_reason
                if calls is None:
                    bodies = [{"delta": {"content": delta}} if chat else {"text": delta}]
                else:
                    items = calls.feed(delta) + (calls.finish() if finished else [])
                    bodies = []
                    for item in items:
                        if isinstance(item, ToolCall):
                            bodies += [{"delta": {"tool_calls": [d]}} for d in item.stream_deltas(called)]
                            called += 1
                        else:
                            bodies.append({"delta": {"content": item}})
                    if finished:
                        bodies.append({"delta": {}})
                        reason = _with_calls(reason) if called else reason
                for i, body in enumerate(bodies):
                    last = finished and i == len(bodies) - 1
                    yield _sse({**meta, "object": kind,
                                "choices": [{"index": 0, **body, "finish_reason": reason if last else None}]})
            yield "data: [DONE]\n\n"
        finally:
            if not finished or answer.stopped:
                worker.cancel(ticket)

    def _stream_failure(request_id: str, event) -> str:
        if event == "timeout":
            return f"no answer within {limits.request_timeout_s:g} s"
        return _failure(request_id, event if isinstance(event, Exception) else event.finished)

    return app


class _Answer:
    """The text of an answer as tokens arrive (decoded once per event), cut at the first stop string."""

    def __init__(self, model: LoadedModel, stops: list[str]) -> None:
        self.model, self.stops = model, stops
        self.token_ids: list[int] = []
        self.stopped = False
        self._text = ""  # the decoded answer so far, cut at a stop string once one appears
        self._sent = ""

    def add(self, event: StepEvent) -> None:
        if self.stopped:
            return
        self.token_ids.extend(event.new_tokens)
        self._text = self.model.decode(self.token_ids)
        found = [self._text.find(s) for s in self.stops if s in self._text]
        if found:
            self.stopped = True
            self._text = self._text[: min(found)]

    def text(self) -> str:
        return self._text

    def new_text(self, final: bool) -> str | None:
        """What is new since the last call; None while the text ends inside a multi-byte character (or
        could still turn into a stop string) and more is coming."""
        text = self._text
        if not final and not self.stopped:
            if text.endswith("\ufffd"):
                return None
            # hold back a tail that may be the start of a stop string
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[: max(len(self._sent), len(text) - hold)]
        delta, self._sent = text[len(self._sent):], text
        return delta


def _with_calls(reason: str) -> str:
    """The finish reason of an answer with tool calls: "tool_calls", unless max_tokens cut it."""
    return "tool_calls" if reason == "stop" else reason


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
