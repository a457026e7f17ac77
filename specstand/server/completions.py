"""Answering a completion request, chat or plain: checks, the engine request, then the answer whole or streamed.

What a request can break stays with that request: every field the engine cannot honour is refused with a 400
naming it, tokenisation runs off the event loop, each request has a server-side deadline, and a client that
leaves frees its slot. With a tool-call parser, a chat answer to a request offering tools is read for calls
(tool_calls.py) and returned, or streamed, as OpenAI's `tool_calls`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specstand.engine import GenerationResult, Request, StepEvent
from specstand.models import LoadedModel, ModelError
from specstand.server.bodies import CompletionRequest, SamplingFields, ServerLimits, prompt_chars
from specstand.server.errors import Refused, error_response
from specstand.server.tool_calls import ToolCall, ToolCallStream, parse_answer
from specstand.server.worker import EngineWorker, Overloaded
from specstand.verification import SamplingParams

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does): their distribution is a point


@dataclass(frozen=True)
class ToolParsing:
    """How this request's answer is read for tool calls: the parser and the names the request offers."""

    parser: str
    tool_names: frozenset[str]


class Completer:
    """The work every completion route shares, for one served model and its engine worker."""

    def __init__(self, model: LoadedModel, worker: EngineWorker, served_name: str, limits: ServerLimits) -> None:
        self.model, self.worker, self.served_name, self.limits = model, worker, served_name, limits
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="specstand-tokenizer")  # one at a time

    async def tokenize(self, function: Callable[..., list[int]], *args, **kwargs) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._tokenizer_thread, lambda: function(*args, **kwargs))
        except ModelError as error:
            raise Refused(400, str(error), "messages") from None
        except Exception as error:  # a chat template that cannot render these messages is the client's input
            raise Refused(400, f"the chat template failed on these messages: {type(error).__name__}: {error}",
                          "messages") from None

    def check(self, body: SamplingFields) -> None:
        if body.model not in (None, self.served_name):
            raise Refused(404, f"model {body.model!r} does not exist (serving {self.served_name!r})", "model")
        fields = body.unsupported()
        if fields:
            raise Refused(400, f"{', '.join(fields)} {'is' if len(fields) == 1 else 'are'} not supported by this "
                          "server", fields[0])
        if prompt_chars(body) > self.limits.max_prompt_chars:
            raise Refused(400, f"the prompt is over {self.limits.max_prompt_chars} characters", "messages")

    def check_prompt_ids(self, body: CompletionRequest) -> list[int]:
        """A prompt sent as token ids, used as they are (what train-data --endpoint sends)."""
        vocab = self.model.decoder.shape.vocab_size
        if not all(0 <= t < vocab for t in body.prompt):
            raise Refused(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(body.prompt)

    async def complete(self, body: SamplingFields, prompt_ids: list[int], http: HttpRequest, chat: bool,
                       parsing: ToolParsing | None = None, tools: list[dict] | None = None) -> Response:
        request = self._request(body, prompt_ids, tools)  # the tools offered, which schema drafting follows
        try:
            ticket, events = self.worker.submit(request)
        except ValueError as error:
            raise Refused(400, str(error), "max_tokens") from None
        except Overloaded as error:
            raise Refused(429, str(error), kind="rate_limit_error") from None
        meta = {"id": http.state.request_id, "created": int(time.time()), "model": self.served_name}
        answer = AnswerText(self.model, body.stop_strings())
        deadline = time.monotonic() + self.limits.request_timeout_s
        if body.stream:
            usage_of = len(prompt_ids) if body.include_usage else None
            return StreamingResponse(self._stream(ticket, events, answer, meta, chat, deadline, parsing, usage_of),
                                     media_type="text/event-stream")
        try:
            outcome = await self._wait(ticket, events, answer, http, deadline)
        except asyncio.CancelledError:
            self.worker.cancel(ticket)
            raise
        if outcome == "disconnected":
            return Response(status_code=499)  # the client went away; its slot is freed
        if outcome == "timeout":
            return error_response(504, f"no answer within {self.limits.request_timeout_s:g} s", "timeout")
        if isinstance(outcome, Exception) or (outcome != "stopped" and outcome.finish_reason == "error"):
            message = self._failure(meta["id"], outcome)
            return error_response(500, message, "internal_error")
        result = None if outcome == "stopped" else outcome
        return JSONResponse(_full_response(answer, result, meta, chat, len(prompt_ids), parsing))

    def _request(self, body: SamplingFields, prompt_ids: list[int], tools: list[dict] | None) -> Request:
        engine = self.worker.engine
        room = engine.answer_room(len(prompt_ids))
        if room <= 0:
            raise Refused(400, f"the prompt ({len(prompt_ids)} tokens) fills the context of "
                               f"{engine.runner.capacity} tokens", "messages")
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked or min(self.limits.default_max_tokens, room)
        temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
        seed = None if body.seed is None else body.seed % 2**64
        try:
            return Request(prompt_ids, max_tokens, SamplingParams(temperature, body.top_p, max(body.top_k, 0), seed),
                           self.model.stop_token_ids, tools, body.response_format)
        except ValueError as error:
            raise Refused(400, str(error)) from None

    def _failure(self, request_id: str, outcome: Exception | GenerationResult) -> str:
        """The client's message for a request the engine failed, logged (the engine or its worker logged the
        traceback, with the engine's request id, which this line ties to the client's)."""
        if isinstance(outcome, Exception):
            message = f"engine failed: {type(outcome).__name__}: {outcome}"
        else:
            message = f"this request failed in the engine: {outcome.error}"
        engine_id = "" if isinstance(outcome, Exception) else f" (engine request {outcome.request_id})"
        logger.error("request %s%s: %s", request_id, engine_id, message)
        return f"{message} (request {request_id})"

    async def _next_event(self, events: asyncio.Queue, deadline: float, http: HttpRequest | None):
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

    async def _wait(self, ticket: int, events: asyncio.Queue, answer: AnswerText, http: HttpRequest,
                    deadline: float):
        while True:
            event = await self._next_event(events, deadline, http)
            if isinstance(event, (str, Exception)):
                if isinstance(event, str):
                    self.worker.cancel(ticket)
                return event
            answer.add(event)
            if event.finished is not None:
                return event.finished
            if answer.stopped:  # a stop string: the engine can drop the rest (its stats go to /metrics from there)
                self.worker.cancel(ticket, "finished")
                return "stopped"

    async def _stream(self, ticket: int, events: asyncio.Queue, answer: AnswerText, meta: dict, chat: bool,
                      deadline: float, parsing: ToolParsing | None, usage_of: int | None) -> AsyncIterator[str]:
        """The answer's chunks; with `usage_of` (the prompt's tokens: stream_options.include_usage), a last
        chunk with the usage and no choices."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        calls = ToolCallStream(parsing.parser, parsing.tool_names) if parsing else None
        called = 0  # tool calls streamed so far
        finished = False
        try:
            if chat:
                yield _sse({**meta, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                                   "finish_reason": None}]})
            while not finished:
                event = await self._next_event(events, deadline, None)
                if isinstance(event, (str, Exception)) or (
                    event.finished is not None and event.finished.finish_reason == "error"
                ):
                    message = self._stream_failure(meta["id"], event)
                    yield _sse({"error": {"message": message, "type": "internal_error"}})
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
            if finished and usage_of is not None:
                yield _sse({**meta, "object": kind, "choices": [], "usage": _usage(usage_of, len(answer.token_ids))})
            yield "data: [DONE]\n\n"
        finally:
            if not finished or answer.stopped:
                self.worker.cancel(ticket, "finished" if finished else "cancelled")

    def _stream_failure(self, request_id: str, event) -> str:
        if event == "timeout":
            return f"no answer within {self.limits.request_timeout_s:g} s"
        return self._failure(request_id, event if isinstance(event, Exception) else event.finished)


def _full_response(answer: AnswerText, result: GenerationResult | None, meta: dict, chat: bool, prompt_tokens: int,
                   parsing: ToolParsing | None) -> dict:
    """`result`: the engine's, or None where a stop string ended the answer first (its stats then reach
    /metrics when the engine drops it, and the reply carries none rather than zeros)."""
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
        "usage": _usage(prompt_tokens, completion_tokens),
        "specstand": {"token_ids": answer.token_ids, **({"stats": result.stats.to_dict()} if result else {})},
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class AnswerText:
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
        before = len(self.token_ids)
        self.token_ids.extend(event.new_tokens)
        self._text = self.model.decode(self.token_ids)
        cut = self._stop_at(self._text)
        if cut is not None:
            self.stopped = True
            self._text = self._text[:cut]
            # the answer's tokens end with the one that completed the stop string (as vLLM counts them): a
            # verified draft may have brought more in the same pass
            end = before + 1
            while self._stop_at(self.model.decode(self.token_ids[:end])) is None:
                end += 1
            del self.token_ids[end:]

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop string in `text` starts (None: none is in it)."""
        found = [text.find(s) for s in self.stops if s in text]
        return min(found) if found else None

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
