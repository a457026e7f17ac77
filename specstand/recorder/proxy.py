"""Record an agent's calls through a pass-through proxy into the workload format.

Point the agent's OpenAI base URL at the proxy. Calls are grouped into turns by the `X-Turn-Id` header
(or `X-Session-Id`); `X-Call-Id` names a call, `X-Parent-Call-Ids` (comma-separated) lists the calls it
depends on, `X-Stage` labels it. Without parent headers a call depends on the calls of its turn that had
finished before it started, which reproduces what ran in parallel. `delay_ms` is the pause between the
end of its dependencies and its start. A retried identical request within a turn is recorded once. The
workload file is rewritten atomically after every call, so a crash loses at most the call in flight.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specstand.workloads import Call, Turn, save_workload


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


class Recording:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.turns: dict[str, _TurnLog] = {}
        self._anonymous = 0

    def turn_for(self, headers) -> _TurnLog:
        turn_id = headers.get("x-turn-id") or headers.get("x-session-id")
        if not turn_id:
            self._anonymous += 1
            turn_id = f"turn-{self._anonymous}"
        return self.turns.setdefault(turn_id, _TurnLog(turn_id))

    def add(self, turn: _TurnLog, body: dict, headers, start: float, end: float, answer: str) -> None:
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        if key in turn.seen:
            return  # a retry of an identical request
        turn.seen.add(key)
        call_id = headers.get("x-call-id") or f"call{len(turn.calls)}"
        parents = headers.get("x-parent-call-ids")
        if parents is not None:
            depends_on = [p.strip() for p in parents.split(",") if p.strip()]
        else:
            depends_on = [r.call.id for r in turn.calls if r.end <= start]
        ends = [r.end for r in turn.calls if r.call.id in depends_on]
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
            recorded={"answer": answer, "latency_ms": round((end - start) * 1000, 1)},
        )
        turn.calls.append(_Recorded(call, start, end))
        save_workload([Turn(t.turn_id, [r.call for r in t.calls], "recorded") for t in self.turns.values()
                       if t.calls], self.out)


def create_recorder(upstream: str, out: Path) -> FastAPI:
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=600)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="specstand recorder", docs_url=None, redoc_url=None, lifespan=lifespan)
    recording = Recording(out)
    app.state.recording = recording

    @app.get("/v1/models")
    async def models() -> Response:
        reply = await client.get("/v1/models")
        return Response(reply.content, reply.status_code, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _forward(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(request, "/v1/completions", chat=False)

    async def _forward(request: Request, path: str, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "body is not valid JSON", "type": "invalid_request_error",
                                           "code": 400}}, 400)
        turn = recording.turn_for(request.headers)
        start = time.time()
        if body.get("stream"):
            return StreamingResponse(_stream(body, path, chat, turn, request.headers, start),
                                     media_type="text/event-stream")
        reply = await client.post(path, json=body)
        if reply.status_code == 200:
            choice = reply.json()["choices"][0]
            answer = choice["message"]["content"] if chat else choice["text"]
            recording.add(turn, body, request.headers, start, time.time(), answer or "")
        return Response(reply.content, reply.status_code, media_type="application/json")

    async def _stream(body: dict, path: str, chat: bool, turn: _TurnLog, headers, start: float):
        parts: list[str] = []
        async with client.stream("POST", path, json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                    parts.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", ""))
                yield line + "\n"
        recording.add(turn, body, headers, start, time.time(), "".join(parts))

    return app
