"""Record an agent's calls through a pass-through proxy into the workload format.

Point the agent's OpenAI base URL at the proxy. Calls are grouped into turns by the `X-Turn-Id` header
(or `X-Session-Id`); `X-Call-Id` names a call, `X-Parent-Call-Ids` (comma-separated) lists the calls it
depends on, `X-Stage` labels it. Without parent headers a call depends on the calls of its turn that had
finished before it started, which reproduces what ran in parallel. `delay_ms` is the pause between the
end of its dependencies and its start; for a call without any, between the turn's first recorded call and
its start (as the replay reads it), so a call sent while the others were still running starts as late again.
A retried identical request within a turn is recorded once.

The proxy is transparent: the client's end-to-end headers (Authorization included, never recorded) go
upstream, and the upstream's status and error body come back as they were, streaming or not (502 when
the upstream cannot be reached, 504 when it times out). A turn is written once it is finished (no call of
it in flight for `turn_idle_s`, or the recorder stops): appended as one line by a writer thread, with
fsync, after the workload parser has accepted it; so the event loop never waits on the disk, the cost
does not grow with the file, and a crash loses at most the turns still open. A call's `recorded` holds
the answer's text and, where the upstream returned any, its tool calls ([{"name", "arguments"}]).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specstand.workloads import Call, Turn
from specstand.workloads.format import WorkloadError, checked_line

# hop-by-hop headers (RFC 9110) and those httpx sets itself are not forwarded
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}


def forwarded_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


@dataclass
class _Recorded:
    call: Call
    start: float
    end: float


@dataclass
class _TurnLog:
    turn_id: str
    calls: list[_Recorded] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    in_flight: int = 0
    last_activity: float = field(default_factory=time.monotonic)


class TurnWriter:
    """Appends turns to the workload file from its own thread: one JSON line each, flushed and fsynced."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._queue: queue.Queue[Turn | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="specstand-recorder-writer", daemon=True)
        self._thread.start()

    def put(self, turn: Turn) -> None:
        self._queue.put(turn)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        with open(self.out, "a", encoding="utf-8") as file:
            while (turn := self._queue.get()) is not None:
                file.write(turn.to_json() + "\n")
                file.flush()
                os.fsync(file.fileno())


class Recording:
    def __init__(self, writer: TurnWriter, turn_idle_s: float, clock: Callable[[], float] = time.time) -> None:
        """`clock`: what calls' starts and ends are read from (a test's own, to time them exactly)."""
        self.writer = writer
        self.turn_idle_s = turn_idle_s
        self.clock = clock
        self.turns: dict[str, _TurnLog] = {}
        self._taken = _turn_ids(writer.out)  # every turn id the file holds
        self._anonymous = 0
        self._run = time.strftime("%Y%m%d-%H%M%S")  # anonymous turns of different runs get different ids

    def turn_for(self, headers) -> _TurnLog:
        turn_id = headers.get("x-turn-id") or headers.get("x-session-id")
        if not turn_id:
            self._anonymous += 1
            turn_id = f"turn-{self._run}-{self._anonymous}"
        turn = self.turns.setdefault(turn_id, _TurnLog(turn_id))
        turn.in_flight += 1
        turn.last_activity = time.monotonic()
        return turn

    def done(self, turn: _TurnLog) -> None:
        turn.in_flight -= 1
        turn.last_activity = time.monotonic()

    def add(self, turn: _TurnLog, body: dict, headers, start: float, end: float, answer: str,
            tool_calls: list[dict] | None = None) -> None:
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        if key in turn.seen:
            return  # a retry of an identical request
        turn.seen.add(key)
        call_id = headers.get("x-call-id") or f"call{len(turn.calls)}"
        if any(r.call.id == call_id for r in turn.calls):
            call_id = f"{call_id}-{len(turn.calls)}"
        parents = headers.get("x-parent-call-ids")
        known = {r.call.id for r in turn.calls}
        if parents is not None:
            depends_on = [p.strip() for p in parents.split(",") if p.strip() in known]
        else:
            depends_on = [r.call.id for r in turn.calls if r.end <= start]
        ends = [r.end for r in turn.calls if r.call.id in depends_on]
        # a call without dependencies is timed from the turn's first recorded call when the turn is written
        delay_ms = max(0.0, (start - max(ends)) * 1000) if ends else 0.0
        fmt = body.get("response_format") or {}
        schema = (fmt.get("json_schema") or {}).get("schema") if fmt.get("type") == "json_schema" else None
        call = Call(
            id=call_id,
            stage=headers.get("x-stage", ""),
            messages=body.get("messages"),
            prompt=body.get("prompt") if "messages" not in body else None,
            depends_on=depends_on,
            delay_ms=round(delay_ms, 1),
            max_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 256),
            expect_json=fmt.get("type") in ("json_object", "json_schema"),
            json_schema=schema,
            tools=body.get("tools"),
            tool_choice=body.get("tool_choice"),
            recorded={"answer": answer, "latency_ms": round((end - start) * 1000, 1),
                      **({"tool_calls": tool_calls} if tool_calls else {})},
        )
        turn.calls.append(_Recorded(call, start, end))

    def flush(self, everything: bool = False) -> None:
        """Hand finished turns (idle for turn_idle_s; all of them if `everything`) to the writer."""
        now = time.monotonic()
        for turn_id, turn in list(self.turns.items()):
            if turn.in_flight and not everything:
                continue
            if not everything and now - turn.last_activity < self.turn_idle_s:
                continue
            del self.turns[turn_id]
            if turn.calls:
                self._write(turn)

    def _write(self, log: _TurnLog) -> None:
        # an id the file holds already (calls after the turn was written, a recording before this one, or an
        # agent's own "x#2" after x's second part) gets the first free suffix: a workload's ids are unique
        turn_id, part = log.turn_id, 1
        while turn_id in self._taken:
            part += 1
            turn_id = f"{log.turn_id}#{part}"
        first = min(r.start for r in log.calls)  # requests never recorded (a failed try, a cut stream) do not count
        calls = [r.call if r.call.depends_on else replace(r.call, delay_ms=round((r.start - first) * 1000, 1))
                 for r in log.calls]
        turn = Turn(turn_id, calls, "recorded")
        try:
            checked_line(turn, f"recorded turn {turn_id}")
        except WorkloadError as error:  # never write what `bench` would refuse to load
            print(f"specstand record: turn {turn_id} not written: {error}", flush=True)
            return
        self._taken.add(turn_id)
        self.writer.put(turn)


def create_recorder(upstream: str, out: Path, turn_idle_s: float = 30.0, timeout_s: float = 600.0,
                    clock: Callable[[], float] = time.time) -> FastAPI:
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=timeout_s)
    writer = TurnWriter(out)
    recording = Recording(writer, turn_idle_s, clock)
    proxy = _Proxy(client, upstream, recording)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        flusher = asyncio.create_task(_flush_idle_turns(recording))
        yield
        flusher.cancel()
        recording.flush(everything=True)
        writer.close()
        await client.aclose()

    app = FastAPI(title="specstand recorder", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.recording = recording

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.forward(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward(request, "/v1/completions", chat=False)

    return app


async def _flush_idle_turns(recording: Recording) -> None:
    while True:
        await asyncio.sleep(min(1.0, recording.turn_idle_s / 2))
        recording.flush()


def _relayed(reply: httpx.Response) -> Response:
    return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))


class _Proxy:
    """The recorder's routes' work: a client's request sent upstream, the reply relayed as it came, and the
    call recorded once its answer is complete."""

    def __init__(self, client: httpx.AsyncClient, upstream: str, recording: Recording) -> None:
        self.client = client
        self.upstream = upstream
        self.recording = recording

    async def send(self, request: httpx.Request, stream: bool = False) -> httpx.Response | JSONResponse:
        """The upstream's reply, or the 504/502 a client gets when it times out or cannot be reached."""
        try:
            return await self.client.send(request, stream=stream)
        except httpx.TimeoutException:
            return _error(504, f"upstream {self.upstream} timed out", "upstream_timeout")
        except httpx.HTTPError as error:
            return _error(502, f"upstream {self.upstream} unreachable: {type(error).__name__}", "upstream_error")

    async def models(self, request: Request) -> Response:
        reply = await self.send(self.client.build_request("GET", "/v1/models",
                                                          headers=forwarded_headers(request.headers)))
        if isinstance(reply, JSONResponse):
            return reply
        return _relayed(reply)

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object", "invalid_request_error")
        turn = self.recording.turn_for(request.headers)
        start = self.recording.clock()
        stream = bool(body.get("stream"))
        outgoing = self.client.build_request("POST", path, json=body, headers=forwarded_headers(request.headers))
        reply = await self.send(outgoing, stream=stream)
        if isinstance(reply, JSONResponse):
            self.recording.done(turn)
            return reply
        if stream:
            return await self._stream(reply, body, chat, turn, request.headers, start)
        try:
            if reply.status_code == 200:
                self._record_answer(reply, body, chat, turn, request.headers, start)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            pass  # relayed as it came; an answer we cannot read is not recorded
        finally:
            self.recording.done(turn)
        return _relayed(reply)

    def _record_answer(self, reply: httpx.Response, body: dict, chat: bool, turn: _TurnLog, incoming,
                       start: float) -> None:
        choice = _first_choice(reply.json()["choices"])
        answer = choice["message"].get("content") if chat else choice["text"]
        calls = [_call_of(c) for c in (choice["message"].get("tool_calls") or [])] if chat else []
        self.recording.add(turn, body, incoming, start, self.recording.clock(), answer or "", calls)

    async def _stream(self, reply: httpx.Response, body: dict, chat: bool, turn: _TurnLog, incoming,
                      start: float) -> Response:
        if reply.status_code != 200:  # an error is relayed with its own status, not as a 200 stream
            content = await reply.aread()
            await reply.aclose()
            self.recording.done(turn)
            return Response(content, reply.status_code, media_type=reply.headers.get("content-type"))
        relay = self._relay(reply, body, chat, turn, incoming, start)
        return StreamingResponse(relay, media_type=reply.headers.get("content-type", "text/event-stream"))

    async def _relay(self, reply: httpx.Response, body: dict, chat: bool, turn: _TurnLog, incoming,
                     start: float) -> AsyncIterator[str]:
        """The stream's lines as they come; the call is recorded once the stream is complete ([DONE])."""
        answer = _StreamedAnswer(chat)
        complete = False
        try:
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    complete = True
                elif line.startswith("data: "):
                    answer.add(line[6:])
                yield line + "\n"
        finally:
            await reply.aclose()
            if complete:
                self.recording.add(turn, body, incoming, start, self.recording.clock(), "".join(answer.parts),
                                   answer.tool_calls())
            self.recording.done(turn)


def _turn_ids(path: Path) -> set[str]:
    """Turn ids already in the file (recording again appends)."""
    ids: set[str] = set()
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not at U+2028 and the like, which answers hold
    except OSError:
        return ids
    for line in lines:
        try:
            turn_id = json.loads(line).get("turn_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(turn_id, str):
            ids.add(turn_id)
    return ids


def _first_choice(choices: list[dict]) -> dict:
    """The answer recorded is choice 0's (with n > 1 a stream's chunks interleave the choices)."""
    for choice in choices:
        if choice.get("index", 0) == 0:
            return choice
    raise KeyError("no choice 0")


def _call_of(tool_call: dict) -> dict:
    function = tool_call.get("function") or {}
    return {"name": function.get("name"), "arguments": function.get("arguments")}


class _StreamedAnswer:
    """An answer put together from its stream's chunks: the text, and the tool calls by index (a call's
    name comes in its first delta, its arguments in pieces)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.parts: list[str] = []
        self._calls: dict[int, dict] = {}

    def add(self, data: str) -> None:
        try:
            choice = _first_choice(json.loads(data).get("choices") or [])
            delta = choice.get("delta") or {}
        except (ValueError, AttributeError, KeyError):
            return  # relayed as it came; a chunk we cannot read, or of another choice (n > 1), is not recorded
        if not self.chat:
            self.parts.append(choice.get("text") or "")
            return
        self.parts.append(delta.get("content") or "")
        for part in delta.get("tool_calls") or []:
            call = self._calls.setdefault(part.get("index", 0), {"name": None, "arguments": ""})
            function = part.get("function") or {}
            call["name"] = function.get("name") or call["name"]
            call["arguments"] += function.get("arguments") or ""

    def tool_calls(self) -> list[dict]:
        return [self._calls[index] for index in sorted(self._calls)]
